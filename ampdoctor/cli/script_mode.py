"""`ampdoctor diagnose SCRIPT.py [options] [--reference-args ARGS] -- ARGS`: script mode
(CONTRACT §8). The command line becomes a `source.ScriptSource` -- the script, its args, the
reference's args and the same overrides a spec takes, checked the same way -- and then runs
exactly as a spec does (`diagnose.diagnose_here`): in the watched worker process, on the one
ladder, with the same progress, signals, records, reports and CI outputs."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..spec.source import ScriptSource


def script_source_of(script: Path, args: list[str], reference_args: str | None,
                     no_reference: bool, overrides: dict[str, Any]) -> ScriptSource:
    """The script's run source from the command line; UsageError (exit 2) naming what is
    wrong. The reference's arguments are `--reference-args`, else inferred from the script's
    options (`script.infer`: the K option set to 1, the batch option times K), else none with
    `--no-reference`; one that cannot be inferred is exit 2 with the command line to try.
    `overrides`: the spec keys the command line set (`optimizer_steps`, `rungs`,
    `precisions`, `device`, `keep_going`, `capture_output`)."""
    from ..spec.source import script_source
    if not script.is_file():
        raise UsageError(f"{script}: no such script (a .py path selects script mode: "
                         "`ampdoctor diagnose train.py -- ARGS`)")
    if no_reference and reference_args is not None:
        raise UsageError("--no-reference and --reference-args: give one of them")
    from ..script.argv import check_args
    check_args(str(script), list(args))
    how = None
    if reference_args is not None:
        try:
            reference: list[str] | None = shlex.split(reference_args)
        except ValueError as exc:
            raise UsageError(f"--reference-args {reference_args!r}: {exc} (quote it as the "
                             "shell would: --reference-args \"--accum-steps 1 --batch-size "
                             "32\")") from exc
        origin: Any = "given"
    elif no_reference:
        reference, origin = None, None
    else:
        from ..script.infer import infer_reference
        try:
            inferred = infer_reference(str(script), list(args))
        except UsageError as exc:
            raise UsageError(f"{exc.message}. A script whose reference cannot be run at all: "
                             "--no-reference runs only the checks that need none (the "
                             "verdict is then at best inconclusive)", cause=exc) from exc
        reference, origin, how = inferred.args, "inferred", inferred.how
        if inferred.rewrites:
            overrides = {**overrides, "reference_rewrites": list(inferred.rewrites)}
        if inferred.deferred:
            reference = None
            overrides = {**overrides, "reference_batch_option": inferred.batch_option}
    return script_source(script, args, reference, origin, reference_how=how, **overrides)
