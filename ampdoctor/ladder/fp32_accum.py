"""Rung `fp32-accum`: the loop in fp32 with K micro-batches equals the fp32 full-batch
reference, step by step (averaging factor, reduction, zero_grad placement, steps per K)."""

from __future__ import annotations

from collections import Counter
from typing import cast

from ..core.enums import KindId, RungId, Status
from ..core.findings import Finding, RungResult, conclude
from ..core.safetext import safe_str
from ..judge import Judgement
from ..kinds.loop_error import IgnoresMicroBatches, ignores_micro_batches
from ..kinds.mismatch import TooFewSteps, too_few_steps
from ..kinds.precision import AutocastInFp32, autocast_in_fp32
from ..probe.events import AutocastEntered, Backward, SchedulerStep
from ..rules.lr_set_by_hand import lr_set_by_hand_findings
from ..rules.trainer_precision import forced_refusal
from ..session import Session, Trace
from .analysis import (
    compare_trace,
    location,
    loop_error_finding,
    scheduler_findings,
    step_count_finding,
)
from .casts import weight_cast_finding

RUNG = RungId.FP32_ACCUM


def no_gradient_stepped(trace: Trace) -> bool:
    """The loop called optimizer.step() but no backward ran before any step (a Lightning
    `training_step` that returns None: the step is called, the backward skipped)."""
    return not trace.events_of(Backward) and all(step.backwards == 0 for step in trace.steps)


def _no_step(session: Session, trace: Trace, findings: list[Finding]) -> RungResult:
    """No optimizer step took a gradient: said as such (what the other rungs would read as
    nondeterminism or a zero_grad misplaced has nothing to compare)."""
    taken, total = trace.microbatches_taken, len(session.micro_batches)
    finding = too_few_steps(TooFewSteps(RUNG, 0, session.N, session.K, taken, total,
                                        backwards=len(trace.events_of(Backward)),
                                        called_step=len(trace.steps)))
    return RungResult(RUNG, Status.FAIL, "the loop never stepped the optimizer",
                      [finding] + findings)


def run(session: Session) -> RungResult:
    trace = session.trace("fp32")
    cast = weight_cast_finding(session, trace, RUNG)
    if cast is not None:   # the "fp32" run was not fp32: nothing in it can be compared
        return RungResult(RUNG, Status.FAIL, f"the fp32 loop casts the model's weights to "
                          f"{cast.evidence['measured']} ({cast.kind})", [cast])
    if trace.error is not None:
        pinned = forced_refusal(trace.error, safe_str(trace.error), "fp32",
                                session.spec.precisions)
        if pinned is not None:
            return RungResult(RUNG, Status.SKIP, pinned)
        fast = _raised_by_a_fast_schedule(session, trace)
        if fast is not None:
            return RungResult(RUNG, Status.FAIL, "the fp32 loop raised in an LR scheduler's "
                              f"step, which ran ahead of the optimizer ({fast.kind})", [fast])
        finding = loop_error_finding(trace, RUNG)
        return RungResult(RUNG, Status.FAIL, f"the fp32 loop raised ({finding.kind})", [finding])
    findings = (scheduler_findings(session, trace, RUNG)
                or lr_set_by_hand_findings(session, trace, RUNG))
    if trace.steps and no_gradient_stepped(trace):
        return _no_step(session, trace, findings)
    count = step_count_finding(session, trace, RUNG)
    if count is not None:
        what = ("the optimizer steps on every micro-batch"
                if count.kind == KindId.STEP_PER_MICROBATCH
                else "the optimizer steps off the window boundaries (off by one)")
        return RungResult(RUNG, Status.FAIL, what, [count] + findings)
    taken, total = trace.microbatches_taken, len(session.micro_batches)
    if taken == 0:
        backwards = trace.events_of(Backward)
        finding = ignores_micro_batches(IgnoresMicroBatches(
            RUNG, total, len(backwards), len(trace.steps),
            location=location(backwards[0].site if backwards else None)))
        return RungResult(RUNG, Status.FAIL, "the loop ignores `micro_batches`", [finding])
    if not trace.steps:
        return _no_step(session, trace, findings)
    steps_per_optimizer = Counter(s.optimizer for s in trace.steps)
    most = max(steps_per_optimizer.values())
    if most < session.N:
        # Every optimizer stepped less often than once per window: the loop stopped early (a
        # leftover `return`/`break`) or its window condition never fires for the last windows.
        # (One optimizer stepping less often than another, a GAN's n_critic, is not this.)
        last = trace.steps[-1]
        finding = too_few_steps(TooFewSteps(RUNG, most, session.N, session.K, taken, total,
                                            location=location(last.site)))
        return RungResult(RUNG, Status.FAIL, f"{most} optimizer step(s) for {session.N} windows",
                          [finding] + findings)
    mismatch, judgement = compare_trace(session, trace, RUNG, "fp32")
    comparisons = judgement.steps
    autocast = _autocast_in_fp32(session, trace, judgement)
    if autocast is not None and autocast.severity == "error":
        mismatch = [autocast]
    elif autocast is not None:
        findings.append(autocast)
    findings = mismatch + findings
    worst = max((c.metrics.rel_err for c in comparisons), default=0.0)
    return conclude(RUNG, findings, f"{len(comparisons)} optimizer steps match the fp32 "
                    f"reference (max relative error {worst:.2g})",
                    {"max_relative_error": worst, "steps_compared": len(comparisons)})


def _raised_by_a_fast_schedule(session: Session, trace: Trace) -> Finding | None:
    """The loop raised inside an LR scheduler's step (OneCycleLR refuses to step past
    `total_steps`) and the steps before it show that scheduler stepping more than once per
    optimizer step with a learning rate off the schedule: the raise is that mistake's
    consequence, so the finding is `scheduler-per-microbatch` at that line, not a bare
    `loop-error`. None otherwise."""
    site = trace.error_site
    at = [e for e in trace.events_of(SchedulerStep) if site is not None and e.site is not None
          and (e.site.file, e.site.line) == (site.file, site.line)]
    if not at or not trace.steps:
        return None
    fast = [f for f in scheduler_findings(session, trace, RUNG)
            if f.kind == KindId.SCHEDULER_PER_MICROBATCH and f.severity == "error"]
    return fast[0] if fast else None


def _autocast_in_fp32(session: Session, trace: Trace, judgement: Judgement
                      ) -> Finding | None:
    """The fp32 run entered an enabled autocast: the loop hard-codes its precision instead of
    following run.autocast_dtype. An error when the update differs from the reference (it then
    explains the mismatch), a warning when it happens to match."""
    entered = [e for e in trace.events_of(AutocastEntered) if e.enabled
               and e.device_type == session.device.type]
    if not entered:
        return None
    first = entered[0]
    bad = judgement.first_bad
    # the line that chose the dtype: where the autocast was built, if not where it was entered
    where = location(first.created_at or first.site)
    dtype = cast(str, first.dtype)   # an enabled autocast has a dtype
    if bad is None:
        return autocast_in_fp32(AutocastInFp32(RUNG, dtype, len(entered), location=where))
    return autocast_in_fp32(AutocastInFp32(
        RUNG, dtype, len(entered), bad.ordinal, bad.metrics.rel_err, bad.metrics.ratio,
        bad.metrics.cosine, judgement.tolerance.rtol, location=where))
