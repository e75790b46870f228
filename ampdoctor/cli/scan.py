"""`ampdoctor scan PATHS`: the static search for more than one loss-scale owner, and the
static hints (warnings that fail the scan only under `--strict`)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..core.errors import UsageError
from .common import fail


def scan(
    paths: list[Path] = typer.Argument(..., help="Files and folders to search."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    fmt: str = typer.Option("text", "--format", help="text, json or sarif."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write to this file."),
    strict: bool = typer.Option(False, "--strict",
                                help="Static hints (warnings) fail the scan too (exit 1)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Search code and configs for more than one loss-scale owner, and for static hints of
    classic accumulation + AMP mistakes (never runs them)."""
    if fmt not in ("text", "json", "sarif"):
        raise typer.Exit(fail(UsageError(f"--format must be text, json or sarif, not {fmt!r}."),
                              debug))
    if json_out and fmt not in ("text", "json"):
        raise typer.Exit(fail(UsageError(f"--json and --format {fmt}: choose one."), debug))
    from ..scan.command import run_scan
    raise typer.Exit(run_scan([str(p) for p in paths], as_json=json_out or fmt == "json",
                              fmt="json" if json_out else fmt,
                              output=str(output) if output else None, debug=debug,
                              strict=strict))
