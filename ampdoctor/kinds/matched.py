"""The words of a finding whose shape one of compare's hypotheses matched (the accumulation
kinds, and the loss-scale and clip kinds when their factor shows in the consumed gradient).

Each kind's own text stays in its unit (`Kind.matched`, `Kind.who_divides`, and for the
accumulation kinds `accumulation.unaveraged_message`); this module puts them together from the
numbers the rule measured (`HypothesisMatched`, `WrongDivisor`, `LoopSumsUnaveraged`) and hands
the result to the kind's decider. The clip that bit is said once, here (`clipped_lead`).

This module must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.enums import KindId, Severity
from ..core.evidence import Evidence
from ..core.findings import Finding, Location
from . import CATALOGUE, DECIDERS
from .accumulation import (
    UNAVERAGED_FIX,
    Unaveraged,
    double_average,
    missing_accumulation_average,
    unaveraged_message,
)
from .base import Observed
from .scaling import UNSCALED_BACKWARD, UNSCALED_BACKWARD_FIX

#: Every matched message opens with this: what the optimizer consumed...
CONSUMED = "Step {step}: the optimizer consumed "


@dataclass(frozen=True)
class ClipBit:
    """The window's norm clip: the update/reference ratio after it (`after`, None when it did
    not bite), the total norm it saw and its threshold."""

    after: float | None = None
    total_norm: float | None = None
    threshold: float | None = None


def clipped_lead(template: str, clip: ClipBit) -> str:
    """The message's opening when the window's clip bit: the headline is the update the step
    applied (after the clip, what the charts plot), then what the clip was handed."""
    if clip.after is None or clip.total_norm is None or clip.threshold is None \
            or not template.startswith(CONSUMED):
        return template
    return ("Step {step}: the update the step applied was " + f"{float(clip.after):.4g}"
            + "x the reference's after the clip (it saw a total norm "
            + f"{clip.total_norm:.4g} > max_norm {clip.threshold:g}); before the clip, the "
            "optimizer was handed " + template[len(CONSUMED):])


def _shown(weights: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{w:.3g}" for w in weights) + "]"


@dataclass(frozen=True)
class HypothesisMatched:
    """One of compare's hypotheses of `kind` matched the judge's first bad step: the step, the
    consumed/reference norm ratio, K, the cosine, the hypothesis' label, the comparison keys,
    and what else the rule measured: the loop summing K micro-batch means (`unaveraged`), the
    run's equal weights against those the reference implies, the scaled loss never
    backpropagated (`unscaled_backward`, with the scale's line), the framework that drove the
    run when the kind says who divides there."""

    rung: str
    kind: KindId
    step: int
    ratio: float
    K: int
    cosine: float
    label: str
    comparison: Evidence
    clip: ClipBit = field(default_factory=ClipBit)
    unaveraged: Unaveraged | None = None
    weights: tuple[float, ...] | None = None
    reference_weights: tuple[float, ...] | None = None
    unscaled_backward: bool = False
    scale_line: int | None = None
    framework: str | None = None
    forced_clip: float | None = None
    location: Location | None = None


def hypothesis_matched(o: HypothesisMatched) -> Finding:
    """The finding of a matched hypothesis, worded from its kind's unit: an error (the update
    is off the reference by the factor the hypothesis names)."""
    kind = CATALOGUE[o.kind]
    fix = ""
    message = clipped_lead(kind.matched or "{label}", o.clip).format(
        step=o.step, ratio=o.ratio, K=o.K, cos=o.cosine, label=o.label)
    if o.unaveraged is not None:
        # the sum of K equal-weight micro-batch means, against a reference that weighs
        # them otherwise: the size says K only against that sum, not against the reference
        fix = UNAVERAGED_FIX
        message = unaveraged_message(o.step, o.K, o.unaveraged, o.clip.total_norm,
                                     o.clip.threshold, o.clip.after)
    if o.weights is not None and o.reference_weights is not None:
        message += (" The run weighted its micro-batches " + _shown(o.weights)
                    + "; the reference implies " + _shown(o.reference_weights) + ".")
    if o.unscaled_backward:
        message = UNSCALED_BACKWARD.format(
            step=o.step, ratio=o.ratio, label=o.label,
            at=f" at line {o.scale_line}" if o.scale_line is not None else "")
        fix = UNSCALED_BACKWARD_FIX
    sentence = kind.who_divides.get(o.framework) if o.framework else None
    if sentence is not None:
        message += " " + sentence[0].upper() + sentence[1:]
    return DECIDERS[o.kind](Observed(o.rung, Severity.ERROR, message, evidence=o.comparison,
                                     location=o.location, fix=fix, forced_clip=o.forced_clip))


@dataclass(frozen=True)
class WrongDivisor:
    """Right direction, a size no catalogue factor explains: the loss divided by the wrong
    number (`ratio` < 1: too much, > 1: too little)."""

    rung: str
    step: int
    ratio: float
    cosine: float
    K: int
    comparison: Evidence
    clip: ClipBit = field(default_factory=ClipBit)
    forced_clip: float | None = None
    location: Location | None = None


def wrong_divisor(o: WrongDivisor) -> Finding:
    """`double-average` when the update is too small, `missing-accumulation-average` when too
    large: an error either way."""
    decider = double_average if o.ratio < 1 else missing_accumulation_average
    lead = clipped_lead(CONSUMED, o.clip).format(step=o.step)
    return decider(Observed(o.rung, Severity.ERROR,
        f"{lead}{o.ratio:.4g}x the reference gradient with cosine {o.cosine:.5f}: the loss is "
        f"divided by {o.K / o.ratio:.4g} instead of K={o.K}{_summed(o.ratio)}.",
        evidence=o.comparison, location=o.location, forced_clip=o.forced_clip))


def _summed(ratio: float) -> str:
    """What a too-small gradient means for a loss that sums over its samples (YOLOv5's loss x
    batch size, fairseq's): it is divided where the reference divides by nothing."""
    if ratio >= 1:
        return ""
    return (f" (for a loss that averages over its micro-batch; a loss that sums over its "
            f"samples, such as YOLOv5's loss x batch size, is divided by {1 / ratio:.4g} where "
            "it wants no division)")


@dataclass(frozen=True)
class LoopSumsUnaveraged:
    """The loop's own gradient of each micro-batch alone told that the window sums them without
    dividing by K (the reference's per-micro-batch gradients explained nothing)."""

    rung: str
    step: int
    K: int
    unaveraged: Unaveraged
    comparison: Evidence
    clip: ClipBit = field(default_factory=ClipBit)
    forced_clip: float | None = None
    location: Location | None = None


def loop_sums_unaveraged(o: LoopSumsUnaveraged) -> Finding:
    """`missing-accumulation-average` read against the loop's own micro-batch gradients: an
    error."""
    return missing_accumulation_average(Observed(o.rung, Severity.ERROR,
        unaveraged_message(o.step, o.K, o.unaveraged, o.clip.total_norm, o.clip.threshold,
                           o.clip.after),
        evidence=o.comparison, location=o.location,
        fix=UNAVERAGED_FIX if o.unaveraged.weighting_differs else "",
        forced_clip=o.forced_clip))


# --- the sentinel's replay of a window in a real training -------------------------------------


@dataclass(frozen=True)
class ReplayedWindow:
    """The sentinel's fp32 replay of a window against what the step consumed: the ratio and
    cosine, the window's K, the comparison keys, and which factor (if any) the consumed
    gradient is of the full-window reference (K: not averaged, 1/K: averaged twice); None
    with the relative error beyond the precision's allowance otherwise."""

    rung: str
    step: int
    ratio: float
    cosine: float
    K: int
    precision: str
    comparison: Evidence
    factor_kind: KindId | None = None
    rel_err: float = 0.0
    allowed: float = 0.0
    location: Location | None = None


def replayed_window(o: ReplayedWindow) -> Finding:
    """`missing-accumulation-average` (K x), `double-average` (1/K) or `gradient-mismatch`
    (another factor, beyond the tolerance) for a window the sentinel replayed: an error."""
    lead = (f"Optimizer step {o.step}: the optimizer consumed {o.ratio:.4g}x the fp32 "
            f"full-window reference gradient (cosine {o.cosine:.5f})")
    evidence: Evidence = {**o.comparison, "measured": round(o.ratio, 6), "expected": 1.0}
    if o.factor_kind is KindId.MISSING_ACCUMULATION_AVERAGE:
        evidence["factor"] = o.K
        return missing_accumulation_average(Observed(o.rung, Severity.ERROR,
            f"{lead} = the sum of the K={o.K} micro-batch gradients: the loss is not divided "
            "by accumulation_steps.", evidence=evidence, location=o.location))
    if o.factor_kind is KindId.DOUBLE_AVERAGE:
        evidence["factor"] = round(1 / o.K, 6)
        return double_average(Observed(o.rung, Severity.ERROR,
            f"{lead} = 1/K of it: the gradient is averaged twice (the loss divided by "
            f"K={o.K} once too often).", evidence=evidence, location=o.location))
    return DECIDERS[KindId.GRADIENT_MISMATCH](Observed(o.rung, Severity.ERROR,
        f"{lead}, beyond the {o.precision} tolerance (relative error {o.rel_err:.3g}, allowed "
        f"{o.allowed:.3g}).", evidence=evidence, location=o.location))


@dataclass(frozen=True)
class ReplayedWeighting:
    """The sentinel's replay of a token/sample-weighted loss on ragged micro-batches: the
    consumed gradient is `factor` x the equal-weight mean of the micro-batch means (1: a
    weighting mismatch, K: not averaged, 1/K: averaged twice), the weights the run used and
    those the window's counts mean, and what each micro-batch's own mean divides by."""

    rung: str
    step: int
    kind: KindId
    factor: float
    K: int
    ratio: float
    cosine: float
    hypothesis_error: float
    counts: tuple[float, ...]
    own: tuple[float, ...] | None
    comparison: Evidence
    location: Location | None = None


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(float(value), 6)


def _listed(values: tuple[float, ...] | list[float]) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


def replayed_weighting(o: ReplayedWeighting) -> Finding:
    """The finding of a weighting the sentinel named: an error."""
    n = len(o.counts)
    total = sum(o.counts)
    used = [round(1.0 / n, 6)] * n
    meant = [round(c / total, 6) for c in o.counts]
    evidence: Evidence = {**o.comparison, "measured": round(o.ratio, 6), "expected": 1.0,
                          "hypothesis": "equal-weight mean of the per-micro-batch weighted means"
                                        + ("" if o.factor == 1.0 else f" x {o.factor:.6g}"),
                          "hypothesis_error": round(o.hypothesis_error, 6), "weights": used,
                          "reference_weights": meant}
    if o.factor != 1.0:
        evidence["factor"] = o.K if o.factor > 1 else round(o.factor, 6)
    lead = (f"Optimizer step {o.step}: the optimizer consumed "
            + ("" if o.factor == 1.0 else f"{o.factor:.4g}x ")
            + "the equal-weight mean of the micro-batches' own means (norm ratio "
            f"{o.ratio:.4g}, cosine {o.cosine:.5f} to the weighted fp32 reference)")
    weights = (f" The run weighted its micro-batches {_listed(used)}; the reference (the "
               f"window's {_number(total)} items, counted {_listed(o.counts)}) "
               f"weighs them {_listed(meant)}.")
    if o.own is not None and o.own != o.counts:
        weights += (f" Each micro-batch's own mean divides by {_listed(o.own)} items.")
    what = {KindId.WEIGHTED_AVERAGE_MISMATCH:
            ": micro-batches with few tokens count as much as full ones.",
            KindId.MISSING_ACCUMULATION_AVERAGE:
            f": the loss is not divided over the window (K={o.K}).",
            KindId.DOUBLE_AVERAGE:
            f": the gradient is averaged twice (once more by K={o.K})."}
    return DECIDERS[o.kind](Observed(o.rung, Severity.ERROR, lead + what[o.kind] + weights,
                                     evidence=evidence, location=o.location))
