"""`ampdoctor report [RECORD]`: show a saved run record again (terminal, JSON or HTML)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .._version import __version__
from ..core.errors import AmpdoctorError, UsageError
from ..core.safetext import FIELD_LIMIT, inert
from .common import fail, stderr_console, stdout_console

if TYPE_CHECKING:
    from ..record.model import RecordModel


def report(
    record: Path | None = typer.Argument(None, help="A saved run record (default: the latest)."),
    html: bool = typer.Option(False, "--html", help="Write a self-contained HTML postmortem."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Where to write the HTML."),
    json_out: bool = typer.Option(False, "--json", help="Print the record as JSON on stdout."),
    out: Path | None = typer.Option(None, "--out", help="Folder of run records."),
    record_code: bool = typer.Option(False, "--record-exit-code",
                                     help="Exit with the record's own code (1 failed, 3 error) "
                                     "instead of 0 once rendered."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Re-render a saved run record (no torch needed).

    Exit 0 once rendered (a postmortem step does not fail because the run it shows failed;
    --record-exit-code keeps the record's code), 2 for a missing or invalid record or clashing
    options.
    """
    from .. import record as records
    clash = ("-o/--output writes the HTML page: add --html" if output is not None and not html
             else "--html and --json: choose one" if html and json_out else None)
    if clash:
        raise typer.Exit(fail(UsageError(clash + "."), debug))
    try:
        data = show_record(record, html, output, json_out, out)
    except AmpdoctorError as exc:
        raise typer.Exit(fail(exc, debug)) from exc
    except OSError as exc:
        raise typer.Exit(fail(UsageError(f"cannot write the report: {exc}", cause=exc),
                              debug)) from exc
    raise typer.Exit(records.exit_code(data) if record_code else 0)


def show_record(record: Path | None, html: bool, output: Path | None, json_out: bool,
                out: Path | None) -> RecordModel:
    """Load the record (the latest under `out` when none is named) and show it: an HTML page,
    JSON on stdout, or the terminal view. The record, for its exit code."""
    from .. import record as records
    from ..report.terminal import render
    path = record
    if path is None:
        path, interrupted = records.latest_complete(out)
        if interrupted is not None:
            shown = "it is shown" if interrupted == path else f"showing {path.name}"
            stderr_console().print(inert(f"note: the newest record, {interrupted.name}, is of an "
                                         f"interrupted run; {shown}.", limit=FIELD_LIMIT),
                                   highlight=False, markup=False)
    data = records.load(path)
    if (data.record_version or 1) > records.RECORD_VERSION:
        stderr_console().print(inert(f"note: {path} was written by a newer ampdoctor (record "
                                     f"version {data.record_version}, ampdoctor "
                                     f"{data.ampdoctor_version or '?'}); shown with "
                                     f"what ampdoctor {__version__} knows of it.",
                                     limit=FIELD_LIMIT),
                               highlight=False, markup=False)
    if html:
        from ..report.html import write_html
        target = output or Path(path).with_suffix(".html")
        write_html(data, target)
        stderr_console().print(inert(f"HTML report written to {target}"), soft_wrap=True,
                               highlight=False,
                               markup=False)
    elif json_out:
        sys.stdout.write(records.dumps(data, filled=True))
    else:
        render(data, stdout_console())
    return data
