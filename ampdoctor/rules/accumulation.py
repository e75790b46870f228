"""The rule that explains a bad step (`classify_step`): it builds the gradient each known
mistake would produce from the same per-micro-batch reference gradients and names the one that
matches, with the numbers and the line. It never decides *that* a step is bad (the judge
does), and it never runs the user's loop (a re-split pass is asked of the rung driver)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core import thresholds
from ..core.enums import KindId
from ..core.evidence import Evidence
from ..core.findings import Finding, location
from ..judge import Judgement, StepJudgement
from ..kinds import CATALOGUE
from ..kinds.matched import (
    ClipBit,
    HypothesisMatched,
    LoopSumsUnaveraged,
    WrongDivisor,
    hypothesis_matched,
    loop_sums_unaveraged,
)
from ..kinds.matched import wrong_divisor as wrong_divisor_finding
from ..kinds.mismatch import Unexplained, unexplained
from ..kinds.reduction import SummedOverCount, VaryingDivisor
from ..kinds.reduction import summed_over_count as summed_over_count_finding
from ..kinds.reduction import varying_divisor as varying_divisor_finding
from ..kinds.stepping import (
    CarriedOver,
    CarriedShortWindow,
    ZeroedInside,
    carried_short_window,
    zeroed_inside,
)
from ..kinds.stepping import carried_over as carried_over_finding
from ..maths import compare
from ..probe.events import Clip, ZeroGrad, of_type
from ..session import Session, Trace, flat
from . import unaveraged
from .deepspeed import engine_update_off, engine_zero_grad_fix
from .frameworks import dividing_party
from .shapes import (
    SIZE_FACTOR_KINDS,
    Resplit,
    carried_over,
    clip_in_scaled_space,
    disambiguate,
    summed_count,
    varying_ratios,
)
from .sites import (
    NORM_OR_CLIP,
    grad_division_between,
    line_between,
    second_unscale_site,
    unscaled_backward,
)
from .step_case import StepCase, build_case, clip_threshold, clip_would_bite, unclipped

__all__ = ["classify_step", "SHAPES", "direction_holds", "summed_over_count",
           "wrong_divisor", "unclipped", "clip_would_bite"]


def direction_holds(cosine: float) -> bool:
    """The mismatch points the reference's way: only its size is off
    (thresholds.SAME_DIRECTION_COSINE)."""
    return cosine > thresholds.SAME_DIRECTION_COSINE


def summed_over_count(cosine: float, ratio: float) -> bool:
    """Right direction and at least thresholds.SUMMED_MIN_RATIO times the reference: worth
    looking for a count of the window the loss is summed over."""
    return direction_holds(cosine) and ratio > thresholds.SUMMED_MIN_RATIO


def wrong_divisor(cosine: float, ratio: float) -> bool:
    """Same direction, a size factor no catalogue shape explains but a divisor could
    (thresholds.EXACT_DIRECTION_COSINE, WRONG_DIVISOR_RATIO_RANGE, RATIO_NEAR_ONE)."""
    low, high = thresholds.WRONG_DIVISOR_RATIO_RANGE
    return (cosine > thresholds.EXACT_DIRECTION_COSINE and low < ratio < high
            and abs(ratio - 1) > thresholds.RATIO_NEAR_ONE)


def classify_step(session: Session, trace: Trace, rung: str, judgement: Judgement,
                  judged: StepJudgement, rerun: Resplit | None = None,
                  forced_clip: float | None = None) -> Finding:
    """Explain the judge's first bad step. `rerun` is the rung driver's extra fp32 pass
    (`shapes.Resplit`). Each known shape of a mismatch is tried in the order of `SHAPES`; the
    first that matches builds the finding, and `_no_known_shape` reports the numbers."""
    step = judged.step
    snapshot = trace.snapshots.get(step.group)
    if snapshot is None:
        return _unexplained(session, rung, judgement, judged, forced_clip)
    names = [n for n in step.grads if n in session.param_shapes]
    ref = session.reference(judged.window, snapshot.state, snapshot.training, per_mb=True)
    scaled_clip = next((c for c in judged.clips if c.scale is not None and not c.scaled_threshold),
                       None)
    if scaled_clip is not None:
        return clip_in_scaled_space(session, rung, judged, scaled_clip, ref.full,
                                    judgement.tolerance.rtol)
    case = build_case(session, trace, rung, judgement, judged, rerun, snapshot, names, ref,
                      forced_clip)
    for shape in SHAPES:
        finding = shape(case)
        if finding is not None:
            return finding
    return _no_known_shape(case)


def _unexplained(session: Session, rung: str, judgement: Judgement,
                 judged: StepJudgement, forced_clip: float | None = None) -> Finding:
    """A step judged as it happened in a group whose weights were gone by then (a second step
    of the same optimizer without a backward between): the numbers, no explanation."""
    m, tol, precision = judged.metrics, judgement.tolerance, judgement.precision
    ordinal = judged.ordinal
    numbers: Evidence = {"measured": compare._round(m.ratio), "expected": 1.0,
                         "tolerance": tol.rtol, **m.as_evidence(), "step": ordinal,
                         "window": judged.window, "accumulation_steps": session.K,
                         "precision": precision}
    trace = session.traces.get(precision)
    engine = None if trace is None else engine_update_off(
        session, trace, rung, ordinal, precision, m.ratio, m.cosine, tol.rtol, numbers)
    if engine is not None:
        return engine
    return unexplained(Unexplained(
        rung, ordinal, judged.window, precision, m.rel_err, m.ratio, m.cosine, tol.rtol,
        numbers, shape_tried=False, forced_clip=forced_clip,
        location=location(judged.step.site)))


# --- the shapes, in the order they are tried -------------------------------------------------


def _zero_grad_inside(case: StepCase) -> Finding | None:
    """A zero_grad inside the window, when no hypothesis or one of its look-alikes matched."""
    found, K, m = case.found, case.K, case.m
    if not case.inside_zero or (found is not None and found.kind not in (
            KindId.ZERO_GRAD_INSIDE_ACCUMULATION, KindId.DOUBLE_AVERAGE,
            KindId.WEIGHTED_AVERAGE_MISMATCH)):
        return None
    window = case.judged.window
    own = case.trace.window_of_event(case.judged.step)
    size = case.trace.window_size(window)
    unstepped = ((window, size) if own is not None and own > window and size is not None
                 and size < K else None)
    return zeroed_inside(ZeroedInside(
        case.rung, 0 if unstepped else K - (case.contributing_from or 0), K,
        case.judged.ordinal, case.measured_ratio, m.cosine, clipped=case.clip_norm is not None,
        comparison=case.evidence, fix=engine_zero_grad_fix(case.trace),
        forced_clip=case.forced_clip, location=location(case.inside_zero[-1].site),
        unstepped=unstepped))


def _settle_size_factor_tie(case: StepCase) -> None:
    """K equal to the micro-batch size makes "no average" and "sum reduction" the same factor:
    cut the same window differently (the driver's re-split pass) and see which factor moves."""
    found = case.found
    if found is None or found.kind not in SIZE_FACTOR_KINDS:
        return
    rival = SIZE_FACTOR_KINDS[found.kind]
    tied = [h for h in case.hyps if h.kind == rival and float(torch.linalg.vector_norm(
        case.user_u.double() - h.vector.double())) <= case.cand_tol * float(
            torch.linalg.vector_norm(h.vector.double()))]
    if not tied:
        return
    decided, resplit = (disambiguate(case.session, case.judged.window, case.snapshot, case.names,
                                     case.rerun) if case.rerun is not None else (None, {}))
    if decided is None:
        return
    case.evidence["resplit"] = resplit
    if decided != found.kind:
        hyp = tied[0]
        case.found = compare.Classification(hyp.kind, hyp.label, found.rel_err, hyp.factor,
                                            hyp.extra.copy())


def _loop_sums_over_samples(case: StepCase,
                            found: compare.Classification) -> compare.Classification:
    """Relative to the loop's own K = 1 run a sum reduction divided by K looks like a second
    average; the full-batch gradient being the *sum* of micro-batch gradients says the loss sums
    over samples."""
    if (found.kind in (KindId.DOUBLE_AVERAGE, KindId.WEIGHTED_AVERAGE_MISMATCH)
            and case.ref.mode == "loop" and case.per_mb):
        summed = torch.stack(case.per_mb).sum(0)
        if compare.metrics(case.full, summed, compare.Tolerance(case.cand_tol, 0)).ok:
            return compare.Classification(
                KindId.REDUCTION_MISMATCH, "the loss sums over samples (the full-batch gradient is "
                "the sum of the micro-batch gradients) and the loop divides by K only",
                found.rel_err, found.factor, {})
    return found


def _site_of(case: StepCase, kind: str) -> Any:
    """The user's line a matched hypothesis points at."""
    window_events, step_site = case.window_events, case.judged.step.site
    last_backward_site = case.last_backward_site
    if kind == KindId.MISSING_UNSCALE:
        return step_site
    if kind == KindId.UNSCALE_TWICE:
        return second_unscale_site(window_events) or step_site
    if kind == KindId.DOUBLE_AVERAGE:
        return grad_division_between(last_backward_site, step_site) or last_backward_site
    if kind == KindId.CLIP_BEFORE_UNSCALE:
        return line_between(last_backward_site, step_site, NORM_OR_CLIP) or step_site
    return last_backward_site


def _named_shape(case: StepCase) -> Finding | None:
    """A hypothesis of the catalogue matched (after a size-factor tie is settled)."""
    _settle_size_factor_tie(case)
    if case.found is None:
        return None
    found = _loop_sums_over_samples(case, case.found)
    kind, evidence, m, K = found.kind, case.evidence, case.m, case.K
    measured_ratio = case.measured_ratio
    evidence["hypothesis"] = found.label
    evidence["hypothesis_error"] = compare._round(found.rel_err)
    if found.factor is not None:
        evidence["factor"] = compare._round(found.factor)
    evidence.update(found.extra)
    if kind == KindId.CLIP_BEFORE_UNSCALE:
        # as the clip-space rung measures it: how many times the true norm the clip saw
        if m.ratio > 0:
            evidence["measured"] = compare._round(1.0 / m.ratio)
        measured_ratio = m.ratio
    summed = None
    if (kind == KindId.MISSING_ACCUMULATION_AVERAGE and case.per_mb
            and unaveraged.weighting_differs(case.per_mb, case.full, case.cand_tol)):
        # the sum of K equal-weight micro-batch means, against a reference that weighs
        # them otherwise: the size says K only against that sum, not against the reference
        equal_sums = unaveraged.summed_equal_weights(case.user_u, case.per_mb, case.full)
        evidence.update(unaveraged.evidence(equal_sums))
        summed = unaveraged.measured(equal_sums)
    weights = implied = None
    if kind == KindId.WEIGHTED_AVERAGE_MISMATCH and not case.ref.weighted:
        # no weights known: the run's (equal) against the ones the reference implies
        implied = compare.implied_weights(case.full, case.per_mb)
        if implied is not None:
            weights = [compare._round(1.0 / len(case.per_mb))] * len(case.per_mb)
            evidence["weights"] = weights
            evidence["reference_weights"] = implied
    site = _site_of(case, kind)
    unused = unscaled_backward(case.window_events) if kind == KindId.UNSCALE_TWICE else None
    scale_line = None
    if unused is not None:   # 1/S because the scaled loss was never backpropagated
        backward, scale = unused
        scale_site = location(scale.site)
        scale_line = scale_site.line if scale_site else None
        site = backward.site
    party = dividing_party(case.trace, CATALOGUE[kind].who_divides)
    if party is not None:
        evidence["framework"] = party
    return hypothesis_matched(HypothesisMatched(
        case.rung, KindId(kind), case.judged.ordinal, measured_ratio, K, m.cosine, found.label,
        evidence, clip=_clip(case), unaveraged=summed,
        weights=tuple(weights) if weights is not None else None,
        reference_weights=tuple(implied) if implied is not None else None,
        unscaled_backward=unused is not None, scale_line=scale_line, framework=party,
        forced_clip=case.forced_clip, location=location(site)))


def _clip(case: StepCase) -> ClipBit:
    """The window's clip as the unit words it."""
    return ClipBit(case.evidence.get("ratio_after_clip"), case.clip_norm,
                   clip_threshold(case.window_events))


def _carried_over(case: StepCase) -> Finding | None:
    """.grad not cleared after the previous optimizer step."""
    step, names, ordinal = case.judged.step, case.names, case.judged.ordinal
    carried = carried_over(case.session, case.trace, step, names, case.user_u, case.full,
                           case.cand_tol)
    if carried is None:
        return None
    zero_grads = of_type(case.window_events, ZeroGrad) or \
        [e for e in case.trace.events_of(ZeroGrad) if e.seq < step.seq]
    partial = len(carried) < len(names)
    site = zero_grads[-1].site if partial and zero_grads else step.site
    return carried_over_finding(CarriedOver(
        case.rung, ordinal, tuple(carried), len(names), case.measured_ratio, case.evidence,
        forced_clip=case.forced_clip, location=location(site)))


def _short_window_carried(case: StepCase) -> Finding | None:
    """An epoch's last, short window that no step consumed and no zero_grad cleared (the step
    gated by `(i + 1) % K == 0` alone): its gradient rides into the next window's step, whose
    gradient is then both windows' micro-batches at 1/K each."""
    trace, judged, K = case.trace, case.judged, case.K
    window, own = judged.window, trace.window_of_event(judged.step)
    size = trace.window_size(window)
    if own is None or own <= window or size is None or size >= K or case.inside_zero:
        return None
    expected = case.full * (size / K)
    consumed = size
    for later in range(window + 1, own + 1):
        n = trace.window_size(later) or K
        ref = case.session.reference(later, case.snapshot.state, case.snapshot.training)
        expected = expected + flat(case.session, ref.full, case.names) * (n / K)
        consumed += n
    if not compare.metrics(case.user_u, expected, compare.Tolerance(case.cand_tol, 0.0)).ok:
        return None
    return carried_short_window(CarriedShortWindow(
        case.rung, judged.ordinal, window, size, consumed, K, case.measured_ratio,
        case.m.cosine, case.evidence, forced_clip=case.forced_clip,
        location=location(judged.step.site)))


def _summed_over_a_count(case: StepCase) -> Finding | None:
    """Right direction, a size equal to a count every micro-batch shares: a sum reduction."""
    m, measured_ratio = case.m, case.measured_ratio
    if not summed_over_count(m.cosine, measured_ratio):
        return None
    counted = summed_count(case.session.window(case.judged.window), measured_ratio,
                           case.session.spec.micro_batch_size)
    if counted is None:
        return None
    count, what = counted
    return summed_over_count_finding(SummedOverCount(
        case.rung, case.judged.ordinal, measured_ratio, m.cosine, count, what, case.evidence,
        forced_clip=case.forced_clip, location=location(case.last_backward_site)))


def _varying_divisor(case: StepCase) -> Finding | None:
    """A size that changes from step to step: a divisor that varies."""
    ratios = varying_ratios(case.judgement)
    if ratios is None:
        return None
    return varying_divisor_finding(VaryingDivisor(
        case.rung, case.judged.ordinal, case.measured_ratio, tuple(ratios), case.evidence,
        forced_clip=case.forced_clip, location=location(case.last_backward_site)))


def _wrong_divisor(case: StepCase) -> Finding | None:
    """Right direction, wrong size, no catalogue factor: the loss is divided by the wrong
    number (a hard-coded 8 for K=4, K*K): averaged too much or too little."""
    m, measured_ratio, K = case.m, case.measured_ratio, case.K
    if not wrong_divisor(m.cosine, measured_ratio):
        return None
    case.evidence["factor"] = compare._round(measured_ratio)
    return wrong_divisor_finding(WrongDivisor(
        case.rung, case.judged.ordinal, measured_ratio, m.cosine, K, case.evidence,
        clip=_clip(case), forced_clip=case.forced_clip,
        location=location(case.last_backward_site)))


def _loop_sums_unaveraged(case: StepCase) -> Finding | None:
    """The reference's per-micro-batch gradients explain nothing: the loop weighs tokens or
    samples inside a micro-batch its own way. Its own gradient of each micro-batch alone still
    tells whether the window sums them without dividing by K."""
    if case.rerun is None or case.ref.mode != "loss":
        return None
    sums = unaveraged.summed_loop_gradients(case.session, case.judged.window, case.snapshot,
                                            case.names, case.user_u, case.full, case.rerun,
                                            case.cand_tol)
    if sums is None:
        return None
    case.evidence.update(unaveraged.evidence(sums))
    return loop_sums_unaveraged(LoopSumsUnaveraged(
        case.rung, case.judged.ordinal, case.K, unaveraged.measured(sums), case.evidence,
        clip=_clip(case), forced_clip=case.forced_clip,
        location=location(case.last_backward_site)))


def _engine_scale(case: StepCase) -> Finding | None:
    """A DeepSpeed fp16 engine whose update is off by its own loss scale (the loop is right)."""
    m, judged = case.m, case.judged
    return engine_update_off(case.session, case.trace, case.rung, judged.ordinal,
                             case.judgement.precision, m.ratio, m.cosine,
                             case.judgement.tolerance.rtol, case.evidence)


def _no_known_shape(case: StepCase) -> Finding:
    """No known shape: say so, with the numbers (and a clip that bit before the window's last
    backward, at its line: it clipped a partial sum)."""
    m, judged = case.m, case.judged
    last = case.backwards[-1].seq if case.backwards else -1
    early = [c for c in of_type(case.window_events, Clip) if c.seq < last
             and c.total_norm is not None and c.max_norm is not None
             and c.total_norm > c.max_norm]
    site = early[0].site if early else judged.step.site
    if early:
        case.evidence["early_clips"] = len(early)
    return unexplained(Unexplained(
        case.rung, judged.ordinal, judged.window, case.judgement.precision, m.rel_err,
        case.measured_ratio, m.cosine, case.judgement.tolerance.rtol, case.evidence,
        forced_clip=case.forced_clip, location=location(site), early_clips=len(early)))


#: The known shapes of a mismatch, in the order they are tried: each returns its finding, or
#: None when the step does not have its shape.
SHAPES: tuple[Callable[[StepCase], Finding | None], ...] = (
    _engine_scale,
    _zero_grad_inside,
    _named_shape,
    _carried_over,
    _short_window_carried,
    _summed_over_a_count,
    _varying_divisor,
    _wrong_divisor,
    _loop_sums_unaveraged,
)
