"""Rung `fp32-accum`: the loop in fp32 with K micro-batches equals the fp32 full-batch
reference, step by step (averaging factor, reduction, zero_grad placement, steps per K)."""

from __future__ import annotations

from collections import Counter

from .. import compare, deciders
from ..deciders import Observed
from ..enums import RungId, Severity, Status
from ..evidence import Evidence
from ..findings import Finding, RungResult, conclude
from ..probe.events import AutocastEntered, Backward
from ..rules.lr_set_by_hand import lr_set_by_hand_findings
from ..session import Session
from .analysis import (
    compare_trace,
    location,
    loop_error_finding,
    scheduler_findings,
    step_count_finding,
)
from .casts import weight_cast_finding

RUNG = RungId.FP32_ACCUM


def no_gradient_stepped(trace) -> bool:
    """The loop called optimizer.step() but no backward ran before any step (a Lightning
    `training_step` that returns None: the step is called, the backward skipped)."""
    return not trace.events_of(Backward) and all(step.backwards == 0 for step in trace.steps)


def _no_step(session: Session, trace, findings: list[Finding]) -> RungResult:
    """No optimizer step took a gradient: said as such (what the other rungs would read as
    nondeterminism or a zero_grad misplaced has nothing to compare)."""
    taken, total = trace.microbatches_taken, len(session.micro_batches)
    backwards = len(trace.events_of(Backward))
    how = ("it never called optimizer.step()" if not trace.steps else
           f"it called optimizer.step() {len(trace.steps)} time(s), but no backward ran before "
           "any of them (a Lightning `training_step` that returns None skips the backward and "
           "the step: return the loss)")
    finding = deciders.gradient_mismatch(Observed(RUNG, Severity.ERROR,
                      f"No optimizer step was taken in {taken} micro-batches: the fp32 loop took "
                      f"{taken} of {total} micro-batches and ran {backwards} backward pass(es); "
                      f"{how}.",
                      evidence={"measured": 0, "expected": session.N,
                                "microbatches_taken": taken, "backwards": backwards,
                                "optimizer_steps": len(trace.steps)}))
    return RungResult(RUNG, Status.FAIL, "the loop never stepped the optimizer",
                      [finding] + findings)


def run(session: Session) -> RungResult:
    trace = session.trace("fp32")
    cast = weight_cast_finding(session, trace, RUNG)
    if cast is not None:   # the "fp32" run was not fp32: nothing in it can be compared
        return RungResult(RUNG, Status.FAIL, f"the fp32 loop casts the model's weights to "
                          f"{cast.evidence['measured']} ({cast.kind})", [cast])
    if trace.error is not None:
        finding = loop_error_finding(trace, RUNG)
        return RungResult(RUNG, Status.FAIL, f"the fp32 loop raised ({finding.kind})", [finding])
    findings = (scheduler_findings(session, trace, RUNG)
                or lr_set_by_hand_findings(session, trace, RUNG))
    if trace.steps and no_gradient_stepped(trace):
        return _no_step(session, trace, findings)
    count = step_count_finding(session, trace, RUNG)
    if count is not None:
        what = ("the optimizer steps on every micro-batch" if count.kind == "step-per-microbatch"
                else "the optimizer steps off the window boundaries (off by one)")
        return RungResult(RUNG, Status.FAIL, what, [count] + findings)
    taken, total = trace.microbatches_taken, len(session.micro_batches)
    if taken == 0:
        backwards = trace.events_of(Backward)
        finding = deciders.loop_error(Observed(RUNG, Severity.ERROR,
            f"The fp32 loop never took a micro-batch from `micro_batches` (0 of {total}) but ran "
            f"{len(backwards)} backward pass(es) and {len(trace.steps)} optimizer step(s): it "
            "builds its own data, so nothing it does can be compared with the reference. "
            "Iterate the `micro_batches` argument ampdoctor hands to train_loop.",
            evidence={"measured": 0, "expected": total, "backwards": len(backwards),
                      "optimizer_steps": len(trace.steps)},
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
        finding = deciders.gradient_mismatch(Observed(RUNG, Severity.ERROR,
            f"The fp32 loop took {most} optimizer step(s) for the {session.N} windows of "
            f"K={session.K} micro-batches in the spec (it took {taken} of {total} "
            "micro-batches): it stops early or never steps for the last windows, so those "
            "windows' data never reaches the model.",
            evidence={"measured": most, "expected": session.N, "microbatches_taken": taken,
                      "microbatches": total},
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


def _autocast_in_fp32(session: Session, trace, judgement) -> Finding | None:
    """The fp32 run entered an enabled autocast: the loop hard-codes its precision instead of
    following run.autocast_dtype. An error when the update differs from the reference (it then
    explains the mismatch), a warning when it happens to match."""
    entered = [e for e in trace.events_of(AutocastEntered) if e.enabled
               and e.device_type == session.device.type]
    if not entered:
        return None
    first = entered[0]
    bad = judgement.first_bad
    dtype = first.dtype
    evidence: Evidence = {"measured": dtype, "expected": "no autocast",
                          "autocast_entered": len(entered)}
    severity: Severity
    if bad is not None:
        evidence.update({"step": bad.ordinal, "relative_error": compare._round(bad.metrics.rel_err),
                         "ratio": compare._round(bad.metrics.ratio),
                         "cosine": compare._round(bad.metrics.cosine),
                         "tolerance": judgement.tolerance.rtol})
        message = (f"The fp32 run (run.autocast_dtype is None) entered autocast({dtype}) "
                   f"{len(entered)} time(s): the loop hard-codes its mixed precision, so its "
                   f"'fp32' baseline is really {dtype}. Step {bad.ordinal} differs from the fp32 "
                   f"reference by {bad.metrics.rel_err:.3g} (relative; tolerance "
                   f"{judgement.tolerance.rtol:g}, norm ratio {bad.metrics.ratio:.4g}, cosine "
                   f"{bad.metrics.cosine:.5f}): rounding, not a factor.")
        severity = Severity.ERROR
    else:
        message = (f"The fp32 run entered autocast({dtype}) {len(entered)} time(s) although "
                   "run.autocast_dtype is None: the updates still matched the fp32 reference "
                   "here, but the loop ignores the precision it is asked for.")
        severity = Severity.WARNING
    # the line that chose the dtype: where the autocast was built, if not where it was entered
    return deciders.half_open_amp(Observed(RUNG, severity, message, evidence=evidence,
                   location=location(first.created_at or first.site)))
