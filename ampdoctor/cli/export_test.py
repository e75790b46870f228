"""`ampdoctor export-test [RECORD]`: write a pytest file that keeps a diagnosis fixed."""

from __future__ import annotations

from pathlib import Path

import typer

from ..core.errors import AmpdoctorError
from ..core.safetext import inert
from .common import fail, stderr_console


def export_test(
    record: Path | None = typer.Argument(None, help="A saved run record (default: the latest)."),
    output: Path | None = typer.Option(
        None, "-o", "--output", help="The test file to write (default: "
        "tests/test_ampdoctor_<name>.py, or ./test_ampdoctor_<name>.py without a tests/ "
        "folder)."),
    steps: int = typer.Option(3, "--steps", min=1, max=1000,
                              help="Optimizer steps the test's diagnose runs."),
    force: bool = typer.Option(False, "--force", help="Replace the test file if it exists."),
    out: Path | None = typer.Option(None, "--out", help="Folder of run records."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Turn a diagnosis into a regression test (pytest, CPU, seconds).

    The file re-runs the record's diagnosis (its spec, or its script with the same args and
    reference args, the rungs it ran, a few steps, on the CPU) through ampdoctor's pytest
    plugin. From a failed record it fails until the bug is fixed (healthy, none of the kinds
    found), then keeps it fixed; from a healthy one it keeps the loop healthy. Exit 0 once
    written, 2 for a missing or invalid record, a record with nothing to re-run, or a file
    that exists (without --force).
    """
    from .. import record as records
    from ..runner import export_test as export
    try:
        path = record if record is not None else records.latest_complete(out)[0]
        data = records.load(path)
        target = output if output is not None else export.default_target(data, Path.cwd())
        text = export.render(data, Path(path), target, steps=steps)
        export.write(text, target, force)
    except AmpdoctorError as exc:
        raise typer.Exit(fail(exc, debug)) from exc
    guarded = export.guarded_kinds(data)
    what = (f"keeps {', '.join(guarded)} fixed (fails until it is)" if guarded
            else "keeps the loop healthy")
    stderr_console().print(inert(f"wrote {target}: {what}; run it with: pytest {target}"),
                           soft_wrap=True, highlight=False, markup=False)
