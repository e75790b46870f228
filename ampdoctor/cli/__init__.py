"""The command line: parse, call one function per command, map errors to exit codes.

One module per command (`diagnose`, `report`, `scan`, `explain`, `schema`, `init`); `app`
builds the typer app. The console script is `ampdoctor.cli:main`.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["app", "main"]


def main() -> None:
    """The console script. A script's diagnose starts its worker first (`launch.prestart`: the
    fork server imports torch and the script's libraries while typer parses), then the app."""
    from ..supervise.launch import prestart
    prestart(sys.argv[1:])
    _typer_app()()


def _typer_app() -> Any:
    """typer's app (`commands.py`), imported on first use (`ampdoctor --help` needs typer,
    a script's diagnose starts its worker before)."""
    import importlib
    module = importlib.import_module(f"{__name__}.commands")
    globals()["app"] = module.app
    return module.app


def __getattr__(name: str) -> Any:
    if name == "app":       # `from ampdoctor.cli import app`
        return _typer_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
