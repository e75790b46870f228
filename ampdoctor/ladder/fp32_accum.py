"""Rung `fp32-accum`: the loop in fp32 with K micro-batches equals the fp32 full-batch
reference, step by step (averaging factor, reduction, zero_grad placement, steps per K)."""

from __future__ import annotations

from ..findings import RungResult, conclude
from ..session import Session
from .analysis import compare_trace, loop_error_finding, scheduler_findings, step_count_finding

RUNG = "fp32-accum"


def run(session: Session) -> RungResult:
    trace = session.trace("fp32")
    if trace.error is not None:
        finding = loop_error_finding(trace, RUNG)
        return RungResult(RUNG, "fail", f"the fp32 loop raised ({finding.kind})", [finding])
    findings = scheduler_findings(session, trace, RUNG)
    count = step_count_finding(session, trace, RUNG)
    if count is not None:
        return RungResult(RUNG, "fail", "the optimizer steps on every micro-batch",
                          [count] + findings)
    if not trace.steps:
        from ..findings import Finding
        finding = Finding(RUNG, "gradient-mismatch", "error",
                          f"The fp32 loop consumed {len(session.micro_batches)} micro-batches and "
                          "never called optimizer.step().",
                          evidence={"measured": 0, "expected": session.N})
        return RungResult(RUNG, "fail", "the loop never stepped the optimizer", [finding])
    mismatch, comparisons = compare_trace(session, trace, RUNG, "fp32")
    findings = mismatch + findings
    worst = max((c.metrics.rel_err for c in comparisons), default=0.0)
    return conclude(RUNG, findings, f"{len(comparisons)} optimizer steps match the fp32 "
                    f"full-batch reference (max relative error {worst:.2g})",
                    {"max_relative_error": worst, "steps_compared": len(comparisons)})
