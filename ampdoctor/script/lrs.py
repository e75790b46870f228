"""A script's learning rate against its reference's, step by step.

The reference is the same script with the accumulation set to 1 and the batch K times the
micro-batch: the same training, written without accumulation. Its optimizer must see the same
learning rate at every optimizer step as the run's. Where it does not, the script derives its
learning rate, or its schedule's length, from the micro-batch or the number of micro-batches
(a linear scaling rule applied to `--batch-size` alone; a schedule of `epochs * len(loader)`
steps that runs K times too long) instead of from the optimizer step's batch and the optimizer
steps: every update is off by the ratio of the two, though each gradient matches. The gradient
comparison cannot see it; this check reads the learning rate each step used (group by group,
the first optimizer) in both runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..core.enums import RungId
from ..core.findings import Finding, location
from ..kinds.mismatch import RateOffReference, rate_off_reference
from ..probe.events import SchedulerStep
from ..rules.lr_set_by_hand import lr_assignment, rate_set_per_micro_batch_against

if TYPE_CHECKING:
    from .session import ScriptSession, ScriptTrace

#: relative difference of two learning rates that counts (float32 round-trips, printing)
LR_RTOL = 1e-5


def _differ(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return a != b
    return abs(a - b) > LR_RTOL * max(abs(a), abs(b), 1e-12)


def lr_mismatch(ss: ScriptSession, trace: ScriptTrace) -> Finding | None:
    """`gradient-mismatch` at the first optimizer step whose learning rate differs from the
    reference's (fp32-accum), or None."""
    ref = ss.window_reference
    if ref is None or trace.error is not None:
        return None
    # a rate set on every micro-batch is judged as a spec's is: scheduler-per-microbatch when
    # a step's rate is more than a step of the reference's schedule off, else harmless
    judged, per_micro_batch = rate_set_per_micro_batch_against(
        ss, trace, RungId.FP32_ACCUM, ref)  # type: ignore[arg-type]
    if judged:
        return per_micro_batch
    mine = [s.lrs for s in trace.steps if s.optimizer == 0]
    theirs = [s.lrs for s in ref.steps if s.optimizer == 0]
    for step, (used, meant) in enumerate(zip(mine, theirs, strict=False)):
        if len(used) != len(meant):
            return None          # another set of parameter groups: not the same optimizer
        bad = [g for g, (a, b) in enumerate(zip(used, meant, strict=True)) if _differ(a, b)]
        if not bad:
            continue
        group = bad[0]
        run_lr, ref_lr = used[group], meant[group]
        return _finding(ss, trace, step, group, run_lr, ref_lr)
    return None


def _finding(ss: ScriptSession, trace: ScriptTrace, step: int, group: int, run_lr: float,
             ref_lr: float) -> Finding:
    optimizer = next((o for o in trace.outcome.optimizers if o.get("slot") == 0), None)
    built_at = optimizer.get("site") if optimizer else None
    schedule = [e for e in trace.events if isinstance(e, SchedulerStep)]
    # at step 0 the rate (or a warm-up set from the micro-batch) is the optimizer's; later
    # rates part when the schedule moves at another pace: a scheduler's, or a rate the script
    # assigns itself (`group["lr"] = ...` from a counter of micro-batches)
    if step == 0:
        where = location(built_at)
    elif schedule:
        where = location(schedule[0].site)
    else:
        where = lr_assignment(ss) or location(built_at)  # type: ignore[arg-type]
    return rate_off_reference(RateOffReference(
        RungId.FP32_ACCUM, step, group, run_lr, ref_lr,
        reference_args=" ".join(ss.command.reference_args or []), K=ss.K,
        micro_batch_size=ss.spec.micro_batch_size, scheduled=bool(schedule) or step > 0,
        location=where))
