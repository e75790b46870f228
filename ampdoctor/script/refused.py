"""A run's error as the outcome carries it (`run_error`, `where`), and whose it is: a
script's first run stopped by transformers or accelerate refusing its HF Trainer over the
DeepSpeed config's precision (`rules.trainer_precision`): not the user's bare error, the
double-scaling rung's (`diagnose` names the two settings, as `ampdoctor scan` does). Or by its
own argparse parser refusing the arguments: a usage error naming whose they are."""

from __future__ import annotations

import math
import os
import re
from typing import Any

from ..core.errors import UsageError, UserCodeError, format_traceback
from ..core.safetext import exc_text, safe_str
from ..probe.callsite import CallSiteFinder, Site
from ..rules.trainer_precision import Refusal, refusal

#: argparse's last line before it exits 2: "PROG: error: MESSAGE"
ARGPARSE_ERROR = re.compile(r"^(\S+): error: (.+)$", re.MULTILINE)


class PrecisionsRefused(UserCodeError):
    """The script's first run was refused by transformers or accelerate: its Trainer's
    precision and the DeepSpeed config it hands over disagree."""

    def __init__(self, message: str, met: Refusal,
                 location: tuple[str, int] | None = None) -> None:
        super().__init__(message, location=location)
        self.refusal = met


def refused(outcome: Any) -> None:
    """Raise PrecisionsRefused when a run (a child's `Outcome`) stopped on that refusal."""
    error = outcome.error or {}
    text = str(error.get("text") or "")
    met = refusal(text)
    if met is None:
        return
    site = error.get("site")
    raise PrecisionsRefused(
        f"the script stopped before its first optimizer step: {met.meaning()} "
        f"({text.splitlines()[0][:200] if text else ''})", met,
        location=(site.file, site.line) if site is not None else None)


def arguments_refused(outcome: Any, output: str, args: list[str], reference: list[str]) -> None:
    """Raise UsageError (exit 2) when the script exited 2 with argparse's "error:" line in its
    output: its parser refused the command line. The options the message names say whose they
    are: the user's ARGS (run and reference alike would stop there), else the reference's."""
    if outcome.ended != "exit 2":
        return
    found = list(ARGPARSE_ERROR.finditer(output or ""))
    if not found:
        return
    prog, message = found[-1].group(1), found[-1].group(2).strip()
    named = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w.-]*)", message))
    keys = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    theirs = {a.split("=", 1)[0] for a in reference if a.startswith("-")} - keys
    if named & keys or not named & theirs:
        raise UsageError(
            f"the script's arguments ({' '.join(args) or 'none'}) were refused by its own "
            f"argument parser ({prog}: error: {message}): the run and the reference would both "
            "stop there, before training. Fix the arguments after `--`")
    raise UsageError(
        f"the reference's arguments ({' '.join(reference)}) were refused by the script's "
        f"argument parser ({prog}: error: {message}): give or fix --reference-args (your ARGS "
        "with K = 1 and the batch K times the micro-batch)")


def failed_first(ss: Any, first: Any, cmd_args: list[str]) -> None:
    """The reference's first run (`first`, of the `ScriptSession` `ss`) stopped before its first
    step: whose fault, raised as a UserCodeError. The script run with the user's own arguments
    says it (one more run, only here): when it stops too, the script is what fails, whatever the
    arguments; when it runs, the reference's arguments are."""
    def how(outcome: Any) -> str:
        return f"exited ({outcome.ended})" if outcome.ended.startswith("exit") else "raised"

    own = ss.run(ss.job("fp32", steps=1), "fp32 run")
    if own.error is not None and not own.steps:
        refused(own)
        given = f" ({' '.join(ss.command.args)})" if ss.command.args else ""
        raise UserCodeError(f"the script run with your arguments{given} {how(own)} before its "
                            f"first optimizer step: {own.error.get('text')}",
                            location=where(own.error))
    raise UserCodeError(
        f"the script run with the reference's arguments ({' '.join(cmd_args)}) {how(first)} "
        f"before its first optimizer step: {first.error.get('text')}. With your own arguments "
        "it reaches its first step: the reference's arguments are what fails (K = 1 and the "
        "batch K times the micro-batch must be a command line the script runs)",
        location=where(first.error))


def where(error: dict[str, Any]) -> tuple[str, int] | None:
    """(file, line) of a run's error (`run_error`), None when it has no site."""
    site = error.get("site")
    return (site.file, site.line) if site is not None else None


def run_error(exc: BaseException, finder: CallSiteFinder) -> dict[str, Any]:
    """What a run's error is, for the outcome: its type, text, traceback, the user's line
    (`where` reads it) and the user's frames."""
    site = finder.from_traceback(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        # the file that does not compile, not the import that read it
        site = Site(os.path.realpath(exc.filename), exc.lineno, "<module>")
    return {"type": type(exc).__name__, "message": safe_str(exc), "text": exc_text(exc),
            "traceback": format_traceback(exc), "site": site,
            "frames": finder.user_sites(exc.__traceback__)}


def reference_model_refused(reference: Any, outcome: Any) -> None:
    """The reference (its first run, `reference`) must train the run's model: the same
    parameters, of the same shapes (UsageError, exit 2, with both sizes, before any reference
    is compared)."""
    mine = dict(outcome.param_shapes or {})
    theirs = dict(reference.param_shapes or {}) if reference is not None else {}
    if not mine or not theirs or mine == theirs:
        return

    def size(shapes: dict[str, Any]) -> str:
        count = sum(math.prod(shape) for shape in shapes.values())
        return f"{count:,} parameters in {len(shapes)} tensors"

    differ = next((n for n in mine if n in theirs and tuple(mine[n]) != tuple(theirs[n])),
                  None)
    detail = (f" (`{differ}`: {tuple(theirs[differ])} in the reference, "
              f"{tuple(mine[differ])} in the run)" if differ is not None else "")
    raise UsageError(
        f"--reference-args: the reference builds another model than the run: "
        f"{size(theirs)} in the reference, {size(mine)} in the run{detail}. Give the "
        "reference the run's model arguments; only the accumulation (K = 1) and the batch "
        "(K x b) change")


def reference_batch_refused(rows: int, outcome: Any) -> None:
    """The reference's window (`rows`: what its first optimizer step read) must hold the
    run's whole window: K x b rows."""
    b = outcome.forwards[0].rows if outcome.forwards else 0
    observed = outcome.micro_batches()
    if not rows or not b:
        return
    if rows % b or rows < observed * b:
        raise UsageError(
            f"the reference's optimizer step read {rows} row(s), the run's {observed} "
            f"micro-batch(es) of {b} per step hold {observed * b}: give the reference a "
            f"batch K x b (here {observed * b}) with one micro-batch per optimizer step "
            "(--reference-args). If the reference already holds the whole window, the rows "
            "were counted on another dimension than the batch: ampdoctor reads the first "
            "dimension of the model's first tensor argument (a sequence-first (T, B) "
            "input, or several forwards per micro-batch, cannot be compared in script "
            "mode: write a spec for that loop)")


def one_process(env: dict[str, str], script: str) -> None:
    """A script under a launcher of several ranks (torchrun, deepspeed; `env`: the command's
    environment): not run (UsageError, exit 2). Each rank would start its own diagnose whose
    runs wait for ranks that never come."""
    world = env.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        from .infer import builds_deepspeed_engine
        engine = builds_deepspeed_engine(script)
        raise UsageError(
            f"this process is one of WORLD_SIZE={world} ranks (a launcher started it): script "
            f"mode runs {os.path.basename(script)} in one process (a process group the script "
            "forms is a group of one, RANK=0 WORLD_SIZE=1). Run `ampdoctor diagnose SCRIPT -- "
            "ARGS` without the launcher, or diagnose two ranks with a spec (`ddp: {world_size: "
            + ("2, wrapper: deepspeed}`, docs/frameworks.md)" if engine else "2}`, docs/spec.md)"))
