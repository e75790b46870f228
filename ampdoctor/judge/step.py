"""One optimizer step against the reference (the judge's comparison): the gradient the step
consumed against the reference gradient at the weights it saw, over the micro-batches it
consumed, clipped the way the loop meant (`reference.clip_calls`), at the precision's tolerance.
A clip that bit must also have seen the reference's unclipped norm: clipping both to the same
threshold would otherwise hide any factor. Used by the judge after a run (`judge.judge`) and
as it runs (`judge_live.StepJudge`) alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..core import thresholds
from ..maths import compare
from ..probe.events import Clip, Event, ScalerStep, StepRecord
from ..reference import ClipCall, clip_calls, clip_ops, reference_norm
from ..session import Session, Trace


@dataclass(frozen=True)
class StepJudgement:
    """One optimizer step against the reference."""

    ordinal: int                   # the step group's position in the run
    window: int                    # the window of micro-batches it consumed
    step: StepRecord
    metrics: compare.Metrics       # consumed vs clipped reference
    clips: tuple[ClipCall, ...]
    preclip_ratio: float | None    # norm a clip that bit saw / the reference's unclipped norm
    events: tuple[Event, ...]      # the events since the previous step
    bad: bool

    @property
    def names(self) -> list[str]:
        return list(self.step.grads)


def tolerance(session: Session, precision: str) -> compare.Tolerance:
    default = compare.DEFAULT_TOLERANCES[precision]
    override = session.spec.tolerances.get(precision)  # type: ignore[call-overload]
    if override is None:
        return default
    return compare.Tolerance(override.rtol if override.rtol is not None else default.rtol,
                             override.atol if override.atol is not None else default.atol)


def known_thresholds(session: Session, trace: Trace) -> set[float]:
    """The clip thresholds the loop means: its run's max_grad_norm and whatever its fp32 run
    passed (a loop may clip at its own fixed threshold instead of run.max_grad_norm)."""
    threshold = trace.settings.max_grad_norm
    known = {threshold} if threshold is not None else set()
    fp32 = session.traces.get("fp32")
    if fp32 is not None:
        known |= {e.max_norm for e in fp32.events_of(Clip)
                  if e.max_norm is not None}
    return {float(t) for t in known if math.isfinite(t)}


@dataclass
class StepContext:
    """What judging a step of one trace needs besides the step and its reference."""

    session: Session
    trace: Trace
    precision: str
    tol: compare.Tolerance
    names_of: dict[int, str]
    owner: dict[int, int]
    known: set[float]

    @classmethod
    def of(cls, session: Session, trace: Trace, precision: str,
           known: set[float] | None = None) -> StepContext:
        return cls(session, trace, precision, tolerance(session, precision),
                   trace.parameter_names(), trace.parameter_owners(),
                   known_thresholds(session, trace) if known is None else known)


def step_events(trace: Trace, step: StepRecord, previous_seq: int) -> list[Event]:
    """The events that produced `step`: those since the previous step group's last step, or
    since the last skipped scaler.step before it (a skipped window consumed nothing: its clips
    and unscales are not this step's, the skip threw its gradients away)."""
    skips = [e.seq for e in trace.events_of(ScalerStep) if e.skipped
             and e.seq < step.seq]
    start = max([previous_seq] + skips)
    return [e for e in trace.events if start < e.seq < step.seq]


def judge_one_step(ctx: StepContext, ordinal: int, window: int, step: StepRecord,
                reference: dict[str, torch.Tensor | None], events: list[Event]) -> StepJudgement:
    """One step's consumed gradient against the reference (every parameter's unclipped
    gradient) clipped the way the loop meant; tensor by tensor, no flat copy of either."""
    session, precision, tol = ctx.session, ctx.precision, ctx.tol
    names = [n for n in step.grads if n in session.param_shapes]
    calls = clip_calls(ctx.names_of, events, ctx.owner, ctx.known)
    calls = _hand_clip(calls, ctx.trace, names, step.grads, reference, session, tol)
    # clipped over every parameter (a clip may cover more than the one optimizer whose step is
    # judged), compared over the step's own
    expected, _ = clip_ops(reference, session.param_order, calls)
    m = compare.metrics_of(step.grads, expected, names, session.param_shapes, tol)
    bad = not m.ok and not compare.is_precision_noise(m, precision)
    preclip = _preclip_ratio(reference, calls)
    if not bad and preclip is not None and precision in ("fp32", "bf16"):
        bad = preclip_off(preclip, precision, tol.rtol)
    return StepJudgement(ordinal, window, step, m, tuple(calls), preclip, tuple(events), bad)


def preclip_off(preclip: float, precision: str, rtol: float) -> bool:
    """A clip that bit saw a norm `preclip` times the reference's unclipped norm: too far from 1
    for `precision` (fp32: max(thresholds.RTOL_MULTIPLE x rtol, thresholds.PRECLIP_BAND_FP32);
    bf16: thresholds.PRECLIP_BAND_BF16)."""
    band = (max(thresholds.RTOL_MULTIPLE * rtol, thresholds.PRECLIP_BAND_FP32)
            if precision == "fp32" else thresholds.PRECLIP_BAND_BF16)
    return abs(preclip - 1) > band


def finite_state(state: Mapping[str, torch.Tensor]) -> bool:
    return all(compare.all_finite(v) for v in state.values() if v.is_floating_point())


def _hand_clip(calls: list[ClipCall], trace: Trace, names: list[str], user: compare.Grads,
               reference: Mapping[str, torch.Tensor | None],
               session: Session, tol: compare.Tolerance) -> list[ClipCall]:
    """No clip call was seen but the loop was handed max_grad_norm: it may clip by hand
    (`p.grad.mul_(max_norm / norm)`). The reference then clips all parameters at that threshold,
    unless the unclipped reference fits the consumed gradient better."""
    threshold = trace.settings.max_grad_norm
    if calls or threshold is None or not math.isfinite(threshold):
        return calls
    hand = [ClipCall(None, "norm", tuple(names), 2.0, threshold, threshold, None, None)]
    clipped, _ = clip_ops(reference, names, hand)
    shapes = session.param_shapes
    if (compare.metrics_of(user, clipped, names, shapes, tol).rel_err
            <= compare.metrics_of(user, reference, names, shapes, tol).rel_err):
        return hand
    return calls


def _preclip_ratio(reference: Mapping[str, torch.Tensor | None], calls: list[ClipCall]
                   ) -> float | None:
    """For the last norm clip that bit: the norm it saw (in true space) over the reference's
    unclipped norm of the same parameters."""
    biting = [c for c in calls if c.bit]
    if not biting:
        return None
    call = biting[-1]
    ref_norm = reference_norm(reference, call)
    seen = call.seen_true_norm
    if not ref_norm or seen is None:
        return None
    return seen / ref_norm
