"""Rule `step-per-microbatch` (more optimizer steps than windows) and an off-by-one
accumulation condition (steps off the window boundaries)."""

from __future__ import annotations

from ..core.findings import Finding, location
from ..kinds.mismatch import OffBoundary, off_boundary
from ..kinds.stepping import EngineContext, StepsPerWindow, steps_per_window
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
    for slot, steps in sorted(per_optimizer.items()):
        if len(steps) - _epoch_remainders(steps, session.K) > session.N:
            engine = extra_steps(session, trace)
            return steps_per_window(StepsPerWindow(
                rung, trace.precision, slot, len(steps), session.N, session.K,
                steps[0].backwards, skipped_windows,
                framework=framework_evidence(trace).get("framework"),
                engine=EngineContext(engine.sentence, engine.location, engine.fix,
                                     engine.config_value) if engine is not None else None,
                location=location(steps[0].site)))
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
            return off_boundary(OffBoundary(rung, slot, session.K, tuple(consumed),
                                            location=location(steps[0].site)))
    return None


def _epoch_remainders(steps: list[StepRecord], K: int) -> int:
    """The steps that ended an epoch's short last window: fewer than K micro-batches since the
    step before, and a full window of K before the next step (a script stopped after N steps
    reads on past such a window, so it makes more steps than N windows of K). A step on every
    micro-batch has no full window after its short ones."""
    ends = [s.microbatch for s in steps]
    sizes = [b - a for a, b in zip([-1, *ends], ends, strict=False)]
    return sum(1 for i in range(len(sizes) - 1) if 0 < sizes[i] < K and sizes[i + 1] == K)
