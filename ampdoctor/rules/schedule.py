"""Rule `scheduler-per-microbatch`: judged by the learning rate each optimizer step used
against the schedule's value for that step (a trajectory the rung measures), not by call counts."""

from __future__ import annotations

import math
from typing import Any

from ..core import thresholds
from ..core.findings import Finding, location
from ..judge import step_groups
from ..kinds.schedule import ScheduleTooFast, schedule_too_fast
from ..probe.events import Backward, Forward, OptimizerStep, ScalerStep, SchedulerStep
from ..session import Session, Trace
from .deepspeed import scheduler_cause
from .frameworks import framework_evidence


def scheduler_findings(session: Session, trace: Trace, rung: str) -> list[Finding]:
    """An LR scheduler stepped more than once between two optimizer steps *and* the learning
    rate the optimizer steps used differs from the schedule's value per optimizer step (a
    constant schedule stepped per micro-batch changes nothing and is fine)."""
    scheduler_events = trace.events_of(SchedulerStep)
    if not scheduler_events:
        return []
    # Window boundaries: every scaler.step (skipped or not) and every direct optimizer.step.
    boundaries = [e.seq for e in trace.events if isinstance(e, ScalerStep)
                  or (isinstance(e, OptimizerStep) and not e.via_scaler)]
    per_scheduler: dict[Any, list[SchedulerStep]] = {}
    for e in scheduler_events:
        # one trajectory per scheduler object: two schedulers on one optimizer (warmup + decay)
        # each stepping once per optimizer step are fine
        per_scheduler.setdefault((e.scheduler, e.optimizer),
                                 []).append(e)
    optimizer_steps = max(1, len(step_groups(trace)))
    for (_, slot), events in per_scheduler.items():
        counts: dict[int, int] = {}
        for e in events:
            interval = sum(1 for b in boundaries if b < e.seq)
            counts[interval] = counts.get(interval, 0) + 1
        worst = max(counts.values())
        if worst <= 1:
            continue
        drift = _lr_drift(trace, events, slot)
        if drift is None:
            continue
        step, used, meant = drift
        first = events[0]
        return [schedule_too_fast(ScheduleTooFast(
            rung, trace.precision, first.scheduler_type, len(events), optimizer_steps, worst,
            step, used, meant, cause=scheduler_cause(trace, first.scheduler_type),
            framework=framework_evidence(trace).get("framework"),
            location=location(first.site), raised=trace.error is not None))]
    return []


def run_start(trace: Trace) -> int | None:
    """Where the loop's training work begins: its first forward on a micro-batch it was handed
    (a forward on other data -- a sanity or evaluation pass before training -- reads none), else
    its first forward, else its first backward; None when the trace has none of them."""
    forwards = trace.events_of(Forward)
    on_data = [e for e in forwards if e.index is not None]
    for first in (on_data, forwards, trace.events_of(Backward)):
        if first:
            return first[0].seq
    return None


def _lr_drift(trace: Trace, events: list[SchedulerStep],
              slot: Any) -> tuple[int, float, float] | None:
    """The first optimizer step whose learning rate (from this scheduler's own trajectory)
    differs from the value the schedule gives for that optimizer step; None when every step
    used the right value. Step n used the value after the scheduler's c_n steps so far; it should
    use the value after s + n, where s counts the scheduler steps taken before the run's first
    forward: a schedule deliberately advanced before training starts (resuming, a warm start)
    is an offset, not this mistake. Scheduler steps between the forwards and backwards of the
    first window are not an offset: they are the micro-batch stepping itself, and a warm-up
    short enough to end inside that window changes the first optimizer step's learning rate
    and no later one's. (Without an observed forward or backward, the scheduler steps before
    the first optimizer step stand in for s.)"""
    values = [events[0].lr_before] + [e.lr for e in events]
    if any(v is None for v in values):
        return None if len({v for v in values if v is not None}) <= 1 else (0, math.nan,
                                                                           math.nan)
    lrs = [v for v in values if v is not None]   # (every one, here)
    steps = [s for s in trace.steps if slot is None or s.optimizer == slot]
    first_of_group: dict[int, Any] = {}
    for s in steps:
        first_of_group.setdefault(s.group, s)
    used_index = [sum(1 for e in events if e.seq < s.seq) for s in first_of_group.values()]
    if not used_index:
        return None
    start = run_start(trace)
    offset = (used_index[0] if start is None
              else sum(1 for e in events if e.seq < start))
    for n, c in enumerate(used_index):
        meant_index = offset + n
        if c >= len(lrs) or meant_index >= len(lrs):
            break
        used, meant = float(lrs[c]), float(lrs[meant_index])
        if abs(used - meant) > thresholds.LR_RTOL * max(abs(meant), 1e-30):
            return n, used, meant
    return None


def lr_shift(trace: Trace, events: list[SchedulerStep], slot: Any,
             start_shift: int = 0) -> tuple[float, int | None, float | None, float | None]:
    """How far one scheduler's learning rate at each real optimizer step is from the schedule's
    value for that step (counted in real steps, from the scheduler steps before the run's
    first forward, as `_lr_drift` counts them, plus `start_shift`: the calibration skips it
    advanced on, taken as where the schedule starts): the largest relative difference, the real
    step (0-based) where it is, the learning rate used and the one meant. (0, None, None, None)
    when the trace has no learning rates to compare."""
    values = [events[0].lr_before] + [e.lr for e in events] if events else []
    if not values or any(v is None for v in values):
        return 0.0, None, None, None
    lrs = [float(v) for v in values if v is not None]
    first_of_group: dict[int, Any] = {}
    for s in trace.steps:
        if slot is None or s.optimizer == slot:
            first_of_group.setdefault(s.group, s)
    used_index = [sum(1 for e in events if e.seq < s.seq) for s in first_of_group.values()]
    if not used_index:
        return 0.0, None, None, None
    start = run_start(trace)
    offset = start_shift + (used_index[0] if start is None
                            else sum(1 for e in events if e.seq < start))
    worst: tuple[float, int | None, float | None, float | None] = (0.0, None, None, None)
    for n, c in enumerate(used_index):
        if max(c, offset + n) >= len(lrs):
            break
        used, meant = lrs[c], lrs[offset + n]
        off = abs(used - meant) / max(abs(meant), 1e-30)
        if off > worst[0]:
            worst = (off, n, used, meant)
    return worst
