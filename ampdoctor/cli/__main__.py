"""`python -m ampdoctor.cli ...`, as `python -m ampdoctor ...`."""

from . import main

if __name__ == "__main__":
    main()
