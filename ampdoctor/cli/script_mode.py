"""`ampdoctor diagnose SCRIPT.py [--steps N] [--reference-args ARGS] -- ARGS`: script mode
(CONTRACT §8). The script runs in child processes (`ampdoctor.script`); this process judges
what they report, saves the record and shows it as a spec's."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .common import fail, internal, stderr_console

#: The longest one run of the script may take (seconds), unless AMPDOCTOR_SCRIPT_TIMEOUT_S says.
DEFAULT_TIMEOUT_S = 600.0


def timeout_s() -> float:
    """The time bound of one run of the script: AMPDOCTOR_SCRIPT_TIMEOUT_S, else the default."""
    text = os.environ.get("AMPDOCTOR_SCRIPT_TIMEOUT_S", "").strip()
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError as exc:
        raise UsageError(f"AMPDOCTOR_SCRIPT_TIMEOUT_S={text!r}: give a number of seconds") \
            from exc
    if not value > 0:
        raise UsageError(f"AMPDOCTOR_SCRIPT_TIMEOUT_S={text!r}: give a positive number of "
                         "seconds")
    return value


def run_script_diagnose(script: Path, args: list[str], reference_args: str | None,
                        steps: int | None, json_out: bool, debug: bool, out: Path | None,
                        writable_out: Callable[[Path | None], Path],
                        save_and_show: Callable[..., bool]) -> int:
    """Diagnose `script` run with `args`; the exit code (CONTRACT §5). `writable_out` and
    `save_and_show` are the diagnose command's own (the records folder, the record shown)."""
    try:
        if not script.is_file():
            raise UsageError(f"{script}: no such script (a .py path selects script mode: "
                             "`ampdoctor diagnose train.py -- ARGS`)")
        if steps is not None and steps < 1:
            raise UsageError(f"--steps {steps}: give at least 1 optimizer step")
        try:
            reference = shlex.split(reference_args) if reference_args is not None else None
        except ValueError as exc:
            raise UsageError(f"--reference-args {reference_args!r}: {exc} (quote it as the "
                             "shell would: --reference-args \"--accum-steps 1 --batch-size "
                             "32\")") from exc
        folder = writable_out(out)
        timeout_s()
    except UsageError as exc:
        return fail(exc, debug)
    from ..report.terminal import render
    from ..script.diagnose import run_script
    from ..script.session import Command
    from ..script.spawn import ChildFailed

    err = stderr_console()
    command = Command(str(script), list(args), reference, steps=steps or 3,
                      timeout_s=timeout_s())

    def started(rung: str) -> None:
        if not json_out:
            err.print(f"  rung {rung}", highlight=False, markup=False)

    try:
        record = run_script(command, on_start=started)
    except ChildFailed as exc:   # a bug in ampdoctor, in the process that ran the script
        if debug:
            sys.stderr.write(str(exc))
        return internal(RuntimeError("ampdoctor failed in the process that ran the script"),
                        False)
    except Exception as exc:  # a bug in ampdoctor itself
        return internal(exc, debug)
    from .. import record as records
    code = records.exit_code(record)
    error: dict[str, Any] | None = record.get("error")
    if error:
        label = "usage error" if error.get("exit_code") == 2 else "user code error"
        err.print(f"ampdoctor: {label}: {error.get('message')}", markup=False,
                  highlight=False)
    elif record.get("found") and not json_out:
        err.print(record["found"]["text"], markup=False, highlight=False)
    if not save_and_show(record, folder, json_out, render, err, code):
        return UsageError.exit_code
    return code
