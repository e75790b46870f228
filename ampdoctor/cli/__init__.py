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
    from ..core.launch import prestart
    prestart(sys.argv[1:])
    try:
        _typer_app()()
    except SystemExit as exc:
        leave(exc.code)
    leave(0)


def leave(code: object) -> None:
    """Exit with `code` (SystemExit's: None, an int, or anything else said on stderr and 1)
    without the interpreter's teardown. A diagnose has imported pydantic, rich, typer and their
    hundreds of modules; freeing them one by one at exit took about 80 ms after the record was
    written, for nothing: the process ends anyway. The exit handlers still run (an unused early
    worker is ended there, temporary folders go) and the output streams are flushed (a flush
    that fails exits 120, as the interpreter's own exit does). The interpreter's own exit is
    taken where this process ran training code itself (torch imported: an in-process diagnose,
    rank 0 under torchrun, whose open files and native buffers it flushes) or where a thread
    other than the main one is alive (it waits for non-daemon threads)."""
    import atexit
    import os
    import threading
    if code is None or isinstance(code, int):
        status = 0 if code is None else code & 0xFF if -2**63 <= code < 2**63 else 255
    else:
        print(code, file=sys.stderr)
        status = 1
    if "torch" in sys.modules or threading.active_count() > 1:
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not getattr(stream, "closed", False):
                stream.flush()
        except Exception:  # noqa: BLE001 - as the interpreter: the exit status says it
            status = status or 120
    os._exit(status)


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
