"""The command line: parse, call one function per command, map errors to exit codes.

One module per command (`diagnose`, `report`, `scan`, `explain`, `schema`, `init`); `app`
builds the typer app. The console script is `ampdoctor.cli:main`.
"""

from .app import app, main

__all__ = ["app", "main"]
