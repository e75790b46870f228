"""What every command shares: the consoles, and an error turned into its line and exit code."""

from __future__ import annotations

import sys

from rich.console import Console

from ..errors import AmpdoctorError, LaunchError, SpecError, format_traceback
from ..safetext import MESSAGE_LIMIT, TRACEBACK_LIMIT, exc_text, inert

INTERNAL_ERROR = 4


def stderr_console() -> Console:
    return Console(stderr=True)


def stdout_console() -> Console:
    """The terminal wraps what it shows; piped or redirected output gets whole lines (one
    finding's message on one line, greppable), never a wrap at 80 columns."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=100_000, no_color=True)


def fail(exc: AmpdoctorError, debug: bool) -> int:
    """Print `exc` as `ampdoctor: <label>: <message>` on stderr; its exit code."""
    err = stderr_console()
    if debug and exc.cause is not None:
        sys.stderr.write(inert(format_traceback(exc.cause) or "", limit=TRACEBACK_LIMIT))
    elif debug and exc.remote_traceback:   # raised in the run's process
        sys.stderr.write(inert(exc.remote_traceback))
    label = ("DDP launch error" if isinstance(exc, LaunchError) else
             {2: "spec error" if isinstance(exc, SpecError) else "usage error",
              3: "user code error"}.get(exc.exit_code, "error"))
    err.print(f"[bold red]ampdoctor: {label}:[/] ", end="", highlight=False)
    # (a spec error lists up to 20 problems; a user exception quoted in it is already cut)
    err.print(inert(exc.message, limit=4 * MESSAGE_LIMIT), markup=False, highlight=False)
    return exc.exit_code


def internal(exc: BaseException, debug: bool) -> int:
    """A bug in ampdoctor itself: one line on stderr (the traceback with --debug); exit 4."""
    if debug:
        sys.stderr.write(inert(format_traceback(exc) or "", limit=TRACEBACK_LIMIT))
    err = stderr_console()
    err.print("[bold red]ampdoctor: internal error:[/] ", end="", highlight=False)
    err.print(f"{inert(exc_text(exc))} (run again with --debug for the traceback)",
              markup=False, highlight=False)
    return INTERNAL_ERROR
