"""The per-micro-batch fp32 references of a script's window: what the rules build the known
mistakes from (`compare.window_hypotheses`), as a spec's loop-as-reference gives them.

The script is run with the reference's arguments and its batch option set to the run's
micro-batch size b (K = 1, batch b): its window j reads rows j*b..(j+1)*b, the run's
micro-batch j. Teacher-forced to the step's weights at every window, window g*K + k of that run
is micro-batch k of the run's window g, with its loss normalised over its own rows or tokens as
the script computes it. Each one's rows must be the run's micro-batch row for row (digests, as
`windows.align` checks the whole window); where they are not, or the script has no
batch option ampdoctor can read, there are no per-micro-batch references and the rules name
the mismatch from the whole window only.

A model that normalises over the batch (BatchNorm in training mode) computes its statistics
over each micro-batch: the full-batch reference (K = 1, batch K x b) is not what a correct
accumulation consumes, the mean (or sum) of these per-micro-batch references is
(`reference.per_microbatch_full`, as spec mode's loop-as-reference combines them).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..core.errors import UsageError, UserCodeError
from ..probe.events import EngineBuilt
from ..reference import WindowReference, per_microbatch_full
from .infer import DEEPSPEED_BATCH, deepspeed_options, with_batch

if TYPE_CHECKING:
    from .child import Job, Outcome

Grads = dict[str, torch.Tensor | None]


class ScriptSession(Protocol):
    """What a reference per micro-batch uses of the session (`session.ScriptSession`, which
    imports this module: a protocol, not an import back)."""

    K: int
    notes: set[str]
    #: (id(state), window) -> `per_microbatch` (the states are pinned by the session)
    per_mb_cache: dict[tuple[int, int], tuple[list[Grads], list[float]] | None]
    #: a DeepSpeed script's reference config keys (`_deepspeed`), None for another script
    deepspeed_reference: dict[str, Any] | None

    @property
    def traces(self) -> dict[str, Any]: ...
    @property
    def spec(self) -> Any: ...        # session.ScriptSpec
    @property
    def command(self) -> Any: ...     # session.Command
    @property
    def script(self) -> str: ...
    @property
    def scratch(self) -> Any: ...     # scratch.Scratch
    def job(self, precision: str, *, reference: bool = False, **extra: Any) -> Job: ...
    def run(self, job: Job, what: str) -> Outcome: ...


def batch_statistics(ss: ScriptSession) -> list[str]:
    """The model's modules that normalise over the batch in the fp32 run (BatchNorm)."""
    fp32 = ss.traces.get("fp32")
    return list(fp32.outcome.batch_stats) if fp32 is not None else []


def deferred(ss: ScriptSession, batch_option: str) -> list[str]:
    """The reference command line of a script that derives K itself from a total batch
    (build-nanogpt: `grad_accum_steps = total_batch_size // (B * T)`): one fp32 step shows K
    and the micro-batch b; the reference is the run's arguments with `batch_option` at K x b
    (the total unchanged, so the script's K comes out 1). UsageError (exit 2) when the step
    does not show them."""
    first = ss.run(ss.job("fp32", steps=1), "fp32 run (to read K)")
    if batch_option == DEEPSPEED_BATCH:
        return _deepspeed(ss, first)
    K = first.micro_batches()
    b = first.forwards[0].rows if first.forwards else 0
    args = with_batch(ss.script, list(ss.command.args), K * b, ss.command.cwd) \
        if first.error is None and first.steps and b else None
    if args is None:
        why = (f"it raised: {first.error.get('text')}" if first.error is not None
               else "it made no optimizer step" if not first.steps
               else f"{batch_option} could not be set")
        raise UsageError(f"cannot infer the reference of {ss.script}: a first fp32 step was to "
                         f"show K and the micro-batch, but {why}. Give --reference-args: the "
                         f"script's arguments with {batch_option} K times the micro-batch")
    ss.notes.add(f"the script derives K itself: its first fp32 step showed K = {K} "
                 f"micro-batches of {b}, so the reference sets {batch_option} to {K * b} "
                 f"({' '.join(args)}); give --reference-args to set it yourself")
    return args


def _deepspeed(ss: ScriptSession, first: Outcome) -> list[str]:
    """The reference of a script that builds a DeepSpeed engine: the run's own arguments, its
    engine built with the config's K (`gradient_accumulation_steps`) at 1 and the micro-batch
    at K x b (`script.deepspeed`, `ss.deepspeed_reference`)."""
    engines = [e for e in first.events if isinstance(e, EngineBuilt)]
    b = first.forwards[0].rows if first.forwards else 0
    if first.error is not None or not engines or not first.steps or not b:
        why = (f"it raised: {first.error.get('text')}" if first.error is not None
               else "it built no DeepSpeed engine" if not engines
               else "it made no optimizer step")
        site = first.error.get("site") if first.error is not None else None
        raise UserCodeError(f"{ss.script}: a first fp32 run was to show the DeepSpeed engine's "
                            f"K and micro-batch, but {why}",
                            location=(site.file, site.line) if site is not None else None)
    from_config = engines[0].accumulation_steps
    # the micro-batches the loop fed before the engine's first update: the config's K when the
    # loop calls engine.step() on every micro-batch, as DeepSpeed documents
    K = first.micro_batches() or from_config
    ss.deepspeed_reference = {"gradient_accumulation_steps": 1, DEEPSPEED_BATCH: K * b}
    args = deepspeed_args(ss, engines[0].config_file, {K, from_config}, b, K * b)
    changed = (f"; run with {shlex.join(args)}" if args != list(ss.command.args) else "")
    fed = (f"its config's K = {K} micro-batches of {b}" if from_config == K else
           f"its loop fed K = {K} micro-batches of {b} before the engine's first update (the "
           f"config's gradient_accumulation_steps is {from_config})")
    ss.notes.add(f"the script builds a DeepSpeed engine: {fed}; the reference is the same "
                 "script, its engine's config copy set to "
                 f"gradient_accumulation_steps 1 and {DEEPSPEED_BATCH} {K * b} (fp32, ZeRO "
                 f"stage 0, no clipping{changed}; the user's config is not changed)")
    return args


def deepspeed_args(ss: ScriptSession, config_file: str | None, K: set[int], b: int, batch: int
                   ) -> list[str]:
    """The run's arguments (K micro-batches of b) with the script's own options for K and the
    batch at 1 and `batch` (`infer.deepspeed_options`), and the DeepSpeed config file they name
    (`--deepspeed_config FILE`) replaced by a copy in the diagnose's scratch folder with K = 1
    and the micro-batch `batch`, so a script that reads its config itself for K or the batch
    reads the reference's."""
    args = list(ss.command.args)
    # (the script's own options that feed its config, if any)
    args = deepspeed_options(ss.script, args, K, b, batch, ss.command.cwd)
    if config_file is None:
        return args
    def names_it(arg: str) -> bool:
        named = arg.partition("=")[2] if "=" in arg else arg
        return bool(named) and os.path.abspath(os.path.join(ss.command.cwd, named)) == config_file

    index = next((i for i, arg in enumerate(args) if names_it(arg)), None)
    if index is None:
        return args
    option, joined, _ = args[index].partition("=")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    config.pop("train_batch_size", None)
    config.update({"gradient_accumulation_steps": 1, DEEPSPEED_BATCH: batch})
    folder = os.path.join(ss.scratch.root, "deepspeed")
    os.makedirs(folder, exist_ok=True)
    copy = os.path.join(folder, f"k1-batch{batch}-{os.path.basename(config_file)}")
    with open(copy, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    args[index] = f"{option}={copy}" if joined else copy
    return args


def window_reference(ss: ScriptSession, window: int, state: Mapping[str, torch.Tensor],
                     grads: Grads, per_mb: bool, repeat: bool = False) -> WindowReference:
    """The reference of `window` at `state` from the reference run's gradient `grads`, with the
    per-micro-batch references when asked for (`per_mb`) or when the model normalises over the
    batch, which then make the reference itself (module docstring). `repeat`: a run of its own
    for the repeatability check, `grads` alone."""
    if repeat:
        return WindowReference(full=dict(grads), per_mb=None, counts=None, weighted=False,
                               mode="loop")
    normalising = batch_statistics(ss) if ss.K > 1 else []
    per = None
    if per_mb or normalising:
        key = (id(state), window)
        if key not in ss.per_mb_cache:
            ss.per_mb_cache[key] = per_microbatch(ss, window, state)
        per = ss.per_mb_cache[key]
    full = dict(grads)
    if normalising:
        shown = ", ".join(normalising[:3]) + (", ..." if len(normalising) > 3 else "")
        if per is not None:
            full = per_microbatch_full(per[0], full)
            ss.notes.add(f"the model normalises over the batch ({shown}): the reference "
                         "combines the micro-batches' own fp32 gradients, as a correct "
                         "accumulation does")
        else:
            ss.notes.add(f"the model normalises over the batch ({shown}) and there are no "
                         "per-micro-batch references: the reference's full batch has other "
                         "batch statistics than the run's micro-batches, so a small mismatch "
                         "may be theirs")
    return WindowReference(full=full, per_mb=per[0] if per else None,
                           counts=per[1] if per else None, weighted=False, mode="loop")


def per_microbatch(ss: ScriptSession, window: int, state: Mapping[str, torch.Tensor]
                   ) -> tuple[list[Grads], list[float]] | None:
    """Micro-batch k's own fp32 gradient at `state`, k = 0..K-1 of `window`, and its rows;
    None where they cannot be had (module docstring)."""
    fp32 = ss.traces.get("fp32")
    b = ss.spec.micro_batch_size
    reference_args = ss.command.reference_args
    if fp32 is None or not b or reference_args is None or ss.K < 2:
        return None
    deepspeed = ss.deepspeed_reference
    engines = fp32.events_of(EngineBuilt)
    rewrites = list(ss.command.reference_rewrites or [])
    if any(role == "batch" for role, *_ in rewrites):       # the batch a literal of the script
        args: list[str] | None = list(reference_args)
        rewrites = [(r, name, line, col, b if r == "batch" else v)
                    for r, name, line, col, v in rewrites]
    else:
        args = (deepspeed_args(ss, engines[0].config_file if engines else None, {ss.K}, b, b)
                if deepspeed is not None
                else with_batch(ss.script, list(reference_args), b, ss.command.cwd))
    if args is None:
        return None
    K = ss.K
    first, last = window * K, (window + 1) * K
    job = ss.job("fp32", reference=True, steps=last, teacher=[state] * last)
    job.args = args
    job.rewrites = rewrites or None
    if deepspeed is not None:
        job.deepspeed = {**deepspeed, DEEPSPEED_BATCH: b}
    ref = ss.run(job, "per-micro-batch reference run")
    if ref.error is not None or len(ref.ref_grads) < last:
        return None
    mine = fp32.outcome.forwards[first:last]
    theirs = [[f for f in ref.forwards if f.window == j] for j in range(first, last)]
    if len(mine) < K or any(len(t) != 1 or t[0].digests != m.digests
                            for t, m in zip(theirs, mine, strict=True)):
        ss.notes.add("the script run with its reference's arguments and the batch option set "
                     f"to the micro-batch ({b}) does not read the run's micro-batches one by "
                     "one: a mismatch is named from the whole window only")
        return None
    grads = [ref.ref_grads[j] for j in range(first, last)]
    if any(not g for g in grads):
        return None
    return grads, [float(m.rows) for m in mine]

