"""`ampdoctor diagnose SCRIPT.py [options] [--reference-args ARGS] -- ARGS`: script mode
(CONTRACT §8). The command line becomes a `source.ScriptSource` -- the script, its args, the
reference's args and the same overrides a spec takes, checked the same way -- and then runs
exactly as a spec does (`diagnose.diagnose_here`): in the watched worker process, on the one
ladder, with the same progress, signals, records, reports and CI outputs."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..source import ScriptSource


def script_source_of(script: Path, args: list[str], reference_args: str | None,
                     overrides: dict[str, Any]) -> ScriptSource:
    """The script's run source from the command line; UsageError (exit 2) naming what is
    wrong. `overrides`: the spec keys the command line set (`optimizer_steps`, `rungs`,
    `precisions`, `device`, `keep_going`)."""
    from ..source import script_source
    if not script.is_file():
        raise UsageError(f"{script}: no such script (a .py path selects script mode: "
                         "`ampdoctor diagnose train.py -- ARGS`)")
    try:
        reference = shlex.split(reference_args) if reference_args is not None else None
    except ValueError as exc:
        raise UsageError(f"--reference-args {reference_args!r}: {exc} (quote it as the "
                         "shell would: --reference-args \"--accum-steps 1 --batch-size "
                         "32\")") from exc
    return script_source(script, args, reference,
                         "given" if reference is not None else None, **overrides)
