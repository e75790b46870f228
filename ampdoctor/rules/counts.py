"""Rule `step-per-microbatch` (more optimizer steps than windows) and an off-by-one
accumulation condition (steps off the window boundaries)."""

from __future__ import annotations

from .. import deciders
from ..deciders import Observed
from ..enums import Severity
from ..findings import Finding, location
from ..probe.events import StepRecord
from ..session import Session, Trace
from .deepspeed import extra_steps
from .frameworks import framework_evidence


def step_count_finding(session: Session, trace: Trace, rung: str,
                       skipped_windows: int = 0) -> Finding | None:
    """More optimizer steps than windows: the optimizer steps on every micro-batch."""
    per_optimizer: dict[int, list[StepRecord]] = {}
    for step in trace.steps:
        per_optimizer.setdefault(step.optimizer, []).append(step)
    expected = session.N - skipped_windows
    for slot, steps in sorted(per_optimizer.items()):
        if len(steps) > session.N:
            mb_before_first = steps[0].backwards
            per_window = len(steps) / session.N
            engine = extra_steps(session, trace)
            return deciders.step_per_microbatch(Observed(rung, Severity.ERROR,
                f"The optimizer stepped {len(steps)} times for {session.N} windows of "
                f"K={session.K} micro-batches in the {trace.precision} run "
                f"({per_window:.3g} steps per window; the first step came after "
                f"{mb_before_first} micro-batch(es)). Each update used a fraction of the window."
                + (f" {engine.sentence}" if engine is not None else ""),
                evidence={"measured": len(steps), "expected": expected,
                          "steps_per_window": round(per_window, 6),
                          "microbatches_before_first_step": mb_before_first,
                          "optimizer": slot, **framework_evidence(trace),
                          **({"config_gradient_accumulation_steps": engine.config_value}
                             if engine is not None and engine.config_value is not None
                             else {})},
                location=(engine.location if engine is not None and engine.location
                          else location(steps[0].site)),
                fix=engine.fix if engine is not None else ""))
    # As many steps as windows, but not on window boundaries: an off-by-one accumulation
    # condition (`i % K == 0` with i from 0 steps after the first micro-batch). It shows in
    # the first step, after 1 (or K + 1) micro-batches (a multiple of K when the first windows'
    # steps were skipped, which is no off-by-one); a short window later on is an epoch's
    # remainder (5 micro-batches with K = 2: windows of 2, 2, 1), which the gradient
    # comparison judges like any other window.
    if not trace.lazy_feed:   # micro-batches fetched up front: cadence cannot be read
        return None
    for slot, steps in sorted(per_optimizer.items()):
        consumed = [s.microbatch + 1 for s in steps]
        if consumed and consumed[0] % session.K != 0:
            step, n = steps[0], consumed[0]
            return deciders.gradient_mismatch(Observed(rung, Severity.ERROR,
                f"The optimizer stepped after {n} micro-batch(es), not on a boundary of "
                f"K={session.K}: the accumulation condition is off by one (e.g. "
                "`i % K == 0` with i counted from 0), so the first window holds "
                f"{consumed[0]} micro-batch(es) and every later window straddles two.",
                evidence={"measured": consumed[0], "expected": session.K,
                          "microbatches_at_each_step": consumed, "optimizer": slot},
                location=location(step.site),
                title="The optimizer steps off the window boundaries (off by one)",
                fix="Step when the count of micro-batches seen is a multiple of K: "
                    "`if (i + 1) % K == 0:` with i counted from 0 (or count from 1)."))
    return None
