"""`python -m ampdoctor ...` (and `torchrun ... -m ampdoctor diagnose spec.yaml`)."""

from .cli import main

if __name__ == "__main__":
    main()
