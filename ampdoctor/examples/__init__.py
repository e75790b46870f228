"""The examples `ampdoctor demo` runs: small training loops (one healthy, three with a classic
accumulation + AMP bug marked `# BUG: <kind>`), the model, data and loss they share
(`common.py`), and a spec for each (`NAME.yaml`). They ship with the package so that a plain
`pip install` can show a diagnosis before the user writes anything.

ampdoctor never imports these modules itself: `demo` copies an example into a folder of the
user's (`.ampdoctor/demo/NAME/`) and diagnoses the copy, as it would the user's own project.
"""
