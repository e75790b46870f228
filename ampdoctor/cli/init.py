"""`ampdoctor init [PY_FILE]`: write a commented starter spec."""

from __future__ import annotations

from pathlib import Path

import typer

from ..core.errors import UsageError
from ..core.safetext import inert
from .common import fail, stderr_console


def init(
    py_file: Path | None = typer.Argument(None, help="Your training script: its loop, model "
                                          "and data functions fill the spec in (read, "
                                          "never run)."),
    output: Path = typer.Option(Path("triage.yaml"), "-o", "--output",
                                help="The spec to write (never overwritten)."),
) -> None:
    """Write a commented starter spec, filled in from PY_FILE when given."""
    from ..init.spec import write_starter
    try:
        target, found = write_starter(output, py_file)
    except UsageError as exc:
        raise typer.Exit(fail(exc, False)) from exc
    err = stderr_console()
    if py_file is not None and found is not None and found.train_loop is None:
        from ..init.script import script_command
        proposal = script_command(py_file, str(py_file))
        if proposal is not None and "--reference-args" not in proposal[0]:
            # no option with a default: the reference a diagnose infers without ARGS (K and
            # the micro-batch written in the script as literals, `script.constants`)
            from ..script.infer import infer_reference
            try:
                inferred = infer_reference(str(py_file), [])
                proposal = (f"{proposal[0].removesuffix(' -- ARGS')} --",
                            f"the reference inferred: {inferred.how}")
            except UsageError:
                pass
        if proposal is not None:   # an inline loop: script mode needs no spec at all
            command, how = proposal
            err.print(inert(f"{py_file} trains inline (no train_loop function): diagnose it as "
                            f"it is, in script mode ({how}):"), markup=False, highlight=False)
            print(command)
    err.print(inert(f"wrote {target}"), markup=False, highlight=False)
    if found is not None and found.loss_proposal is not None:
        from ..init.spec import WITHOUT_LOSS
        err.print(inert(f"proposed `loss` ({found.loss_proposal.source}): add this function to "
                        f"{py_file}, then uncomment `loss:` in {target} ({WITHOUT_LOSS})."),
                  markup=False, highlight=False, soft_wrap=True)
        err.print(inert(found.loss_proposal.code, multiline=True), markup=False,
                  highlight=False, soft_wrap=True)
    if found is not None:
        missing = [k for k in ("train_loop", "model", "data") if getattr(found, k) is None]
        if missing:
            err.print(inert(f"fill in: {', '.join(missing)} (marked TODO); then run "
                            f"`ampdoctor diagnose {target}`"), markup=False, highlight=False)
        else:
            err.print(inert(f"next: ampdoctor diagnose {target}"), markup=False,
                      highlight=False)
