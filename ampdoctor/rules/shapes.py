"""Shapes of a mismatch the judge found that need more than a hypothesis vector: a clip in
scaled space, a divisor that varies per step, gradients carried over a step, a loss summed over a
count, and the K = b tie (resolved by a re-split pass the rung driver runs)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

from ..core import thresholds
from ..core.enums import KindId
from ..core.findings import Finding, location
from ..judge import Judgement, StepJudgement
from ..kinds.clipping import ClipInScaledSpace
from ..kinds.clipping import clip_in_scaled_space as clip_in_scaled_space_finding
from ..loading import micro_batch_counts, micro_batch_size_of
from ..maths import compare
from ..probe.events import Snapshot, StepRecord
from ..reference import ClipCall, reference_norm
from ..session import Session, Trace, flat


def clip_in_scaled_space(session: Session, rung: str, judged: StepJudgement, call: ClipCall,
                         reference: dict[str, torch.Tensor | None], tolerance: float) -> Finding:
    """The update differs and a clip ran on gradients still multiplied by the loss scale, at a
    threshold the loop means in true space: the threshold met S x the true norm."""
    m = judged.metrics
    # the caller picks a clip with a scale (a clip in scaled space)
    return clip_in_scaled_space_finding(ClipInScaledSpace(
        rung, judged.ordinal, judged.window, cast(float, call.scale), call.threshold,
        call.total_norm, reference_norm(reference, call), m.ratio, m.as_evidence(), tolerance,
        by_value=call.kind == "value", location=location(call.site)))


def varying_ratios(judgement: Judgement) -> list[float] | None:
    """Right direction at every step, but a size that changes from step to step: the loss is
    normalised by a count that varies (a token count overwritten per micro-batch), not by a
    constant such as K -- so "divide by K" would not fix it. Each step's factor (before its
    clip), or None."""
    same_direction = [s for s in judgement.steps
                      if s.metrics.cosine > thresholds.EXACT_DIRECTION_COSINE]
    if len(same_direction) < 2 or len(same_direction) < len(judgement.steps):
        return None
    ratios = [s.preclip_ratio if s.preclip_ratio is not None else s.metrics.ratio
              for s in same_direction]
    low, high = min(ratios), max(ratios)
    if low <= 0 or high / low - 1 <= thresholds.VARYING_RATIO_SPREAD or all(
            abs(r - 1) < thresholds.RATIO_NEAR_ONE for r in ratios):
        return None
    return ratios


def carried_over(session: Session, trace: Trace, step: StepRecord, names: list[str],
                  user: torch.Tensor, full: torch.Tensor, tol: float) -> list[str] | None:
    """The parameters whose consumed gradient is this window's reference plus what the same
    optimizer's previous step consumed (.grad not cleared between the two steps), when every
    parameter is either that or the reference alone; None otherwise."""
    previous = [s for s in trace.steps if s.group < step.group and s.optimizer == step.optimizer]
    if not previous:
        return None
    prev = flat(session, previous[-1].grads, names).double()
    u, ref = user.double(), full.double()
    carried, offset = [], 0
    for name in names:
        n = math.prod(session.param_shapes[name])
        sl = slice(offset, offset + n)
        offset += n
        fresh_err = relative_difference(u[sl], ref[sl])
        kept_err = relative_difference(u[sl], ref[sl] + prev[sl])
        if kept_err <= tol and kept_err < fresh_err:
            carried.append(name)
        elif fresh_err > tol:
            return None
    return carried or None


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(torch.linalg.vector_norm(b))
    diff = float(torch.linalg.vector_norm(a - b))
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)


def summed_count(micro_batches: list[Any], ratio: float,
                  micro_batch_size: int | None) -> tuple[int, str] | None:
    """A gradient `ratio` times the reference that equals a count every micro-batch of the
    window shares -- its samples, the elements of one of its tensors (tokens of a [b, T]
    label tensor), its non-ignored labels (!= -100) -- is a loss summed over that count."""
    if not micro_batches:
        return None
    per_mb = [micro_batch_counts(mb) for mb in micro_batches]
    shared = {what: n for what, n in per_mb[0].items()
              if n > 1 and all(c.get(what) == n for c in per_mb)}
    for what, n in shared.items():
        if what != "samples" and abs(ratio / n - 1) <= thresholds.COUNT_RATIO_RTOL:
            return int(n), f"the {int(n)} {what} per micro-batch"
    b = micro_batch_size or shared.get("samples")
    if b:
        multiple = compare.nearest_integer_factor(ratio, b)
        if multiple is not None:
            return multiple * int(b), (f"{multiple} x micro_batch_size {int(b)}" if multiple > 1
                                       else f"micro_batch_size {int(b)}")
    return None


SIZE_FACTOR_KINDS: dict[str, str] = {KindId.MISSING_ACCUMULATION_AVERAGE: KindId.REDUCTION_MISMATCH,
                      KindId.REDUCTION_MISMATCH: KindId.MISSING_ACCUMULATION_AVERAGE}


#: The rung driver's extra fp32 pass (`ladder.analysis.rerun_for`): (micro_batches, K,
#: snapshot, label) -> the first step's consumed gradients of the loop run on those
#: micro-batches at accumulation K from the snapshot, and the reference's there (`label` names
#: them in an error); None when the loop could not run it.
Resplit = Callable[[list[Any], int, Snapshot, str],
                   "tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]] | None"]


def disambiguate(session: Session, window: int, snapshot: Snapshot, names: list[str],
                 rerun: Resplit) -> tuple[str | None, dict[str, Any]]:
    """Ask the driver to re-run the first K' = K // 2 micro-batches of the window as one step
    (same micro-batches, so batch statistics do not change) and see whether the gradient's
    factor follows K' (no average) or stays at the micro-batch size (sum reduction)."""
    K2 = max(1, session.K // 2)
    part = session.window(window)[:K2]
    if not part:        # a script's window cannot be handed back to it in parts
        return None, {}
    b = micro_batch_size_of(part[0])
    if b == K2:
        return None, {}
    passed = rerun(part, K2, snapshot, f"the first {K2} micro-batches of window {window}")
    if passed is None:
        return None, {}
    grads, reference = passed
    ratio = float(torch.linalg.vector_norm(flat(session, grads, names))) / max(
        float(torch.linalg.vector_norm(flat(session, reference, names))), 1e-30)
    info = {"accumulation_steps": K2, "micro_batch_size": b, "ratio": compare._round(ratio)}
    if abs(ratio / K2 - 1) < thresholds.RESPLIT_RATIO_RTOL:
        return KindId.MISSING_ACCUMULATION_AVERAGE, info
    if abs(ratio / b - 1) < thresholds.RESPLIT_RATIO_RTOL:
        return KindId.REDUCTION_MISMATCH, info
    return None, info
