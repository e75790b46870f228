"""What every command shares: the consoles, and an error turned into its line and exit code."""

from __future__ import annotations

import os
import sys

from rich.console import Console

from ..core.errors import AmpdoctorError, LaunchError, SpecError, format_traceback
from ..core.safetext import MESSAGE_LIMIT, TRACEBACK_LIMIT, exc_text, inert

INTERNAL_ERROR = 4


def stderr_console() -> Console:
    return Console(stderr=True)


#: the width of output that is not a terminal (a pipe, a CI log) when COLUMNS does not say
PIPED_WIDTH = 100
#: COLUMNS below this is not honoured for piped output (a table would be unreadable)
MIN_PIPED_WIDTH = 60


def piped_width() -> int:
    """Output that is not a terminal is laid out at COLUMNS when it is set (at least
    MIN_PIPED_WIDTH), else at PIPED_WIDTH: tables stay readable in a log or a pager."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return PIPED_WIDTH
    return columns if columns >= MIN_PIPED_WIDTH else PIPED_WIDTH


def stdout_console() -> Console:
    """The terminal lays out at its width; piped or redirected output at `piped_width()`,
    without colour. Either way a path or a number is never cut in the middle
    (`report/terminal.py` gives the summary column room for its longest word)."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=piped_width(), no_color=True)


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
    # not wrapped by rich: a path or a number in the message is never cut (a terminal wraps
    # the line itself; a log keeps it whole)
    err.print(inert(exc.message, limit=4 * MESSAGE_LIMIT), markup=False, highlight=False,
              soft_wrap=True)
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
