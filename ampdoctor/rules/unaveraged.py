"""A window that sums its micro-batches' gradients (no division by K) while its weighting also
differs from the reference's: two mistakes in one gradient.

The factor K is read from the gradient *before* any clip (a clip that bites rescales the whole
gradient, so the update's ratio to the reference is no longer K), and against the combination
of micro-batch gradients the loop actually used, not against the reference: the reference
weighs micro-batches (and tokens within them) its own way, so its norm ratio to the loop's
gradient is K times a weighting factor of no fixed size. The weighting difference is then what
is left between that combination, averaged, and the reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import compare, thresholds
from ..evidence import Evidence
from ..probe.events import Snapshot
from ..session import Session, flat
from .shapes import Resplit


@dataclass(frozen=True)
class Summed:
    """The loop's window gradient (before the clip) against the combination it sums."""

    factor: float             # |user| / |mean of the combination|: K when nothing divides by K
    basis: str                # which per-micro-batch gradients were summed
    mean_vs_reference: compare.Metrics   # the combination's mean against the reference
    per_microbatch_ratio: list[float]    # the loop alone on each micro-batch / its reference
    per_microbatch_cosine: list[float]
    weighting_differs: bool = True      # the mean is not the reference (within the tolerance)


def weighting_differs(per_mb: list[torch.Tensor], full: torch.Tensor, tolerance: float) -> bool:
    """The equal-weight mean of the micro-batch gradients is not the reference: a loop that sums
    them is off by K *and* by the reference's weighting (tokens, samples per micro-batch)."""
    mean = torch.stack(per_mb).mean(0)
    return compare.metrics(mean, full, compare.Tolerance(tolerance, 0.0)).rel_err > tolerance


def summed_equal_weights(user: torch.Tensor, per_mb: list[torch.Tensor],
                         full: torch.Tensor) -> Summed:
    """The loop sums the reference's own per-micro-batch gradients (each a mean over its own
    samples or tokens): the weighting across micro-batches is equal, the reference's is not."""
    mean = torch.stack(per_mb).mean(0)
    return Summed(_ratio(user, mean), "the reference's per-micro-batch gradients",
                  compare.metrics(mean, full, compare.Tolerance(0.0, 0.0)), [], [])


def summed_loop_gradients(session: Session, window: int, snapshot: Snapshot,
                          names: list[str], user: torch.Tensor, full: torch.Tensor,
                          rerun: Resplit, tolerance: float) -> Summed | None:
    """Run the loop alone on each micro-batch of the window (K = 1, from the step's weights,
    unclipped): when the window's gradient is the plain sum of those, the loop divides by
    nothing that follows K, whatever it does inside a micro-batch. None when it is not, or the
    loop could not run so."""
    mbs = session.window(window)
    K = len(mbs)
    if K < 2:
        return None
    alone, ratios, cosines = [], [], []
    for k, mb in enumerate(mbs):
        passed = rerun([mb], 1, snapshot, f"micro-batch {k} of window {window} on its own")
        if passed is None:
            return None
        grads, reference = passed
        g, r = flat(session, grads, names), flat(session, reference, names)
        m = compare.metrics(g, r, compare.Tolerance(0.0, 0.0))
        alone.append(g)
        ratios.append(compare._round(m.ratio))
        cosines.append(compare._round(m.cosine))
    summed = torch.stack(alone).sum(0)
    if compare.metrics(user, summed, compare.Tolerance(tolerance, 0.0)).rel_err > tolerance:
        return None
    mean = summed / K
    against = compare.metrics(mean, full, compare.Tolerance(0.0, 0.0))
    return Summed(_ratio(user, mean), "the loop's own gradient of each micro-batch alone",
                  against, ratios, cosines, weighting_differs=against.rel_err > tolerance)


def message(step: int, K: int, summed: Summed, clip_norm: float | None,
            max_norm: float | None, after_clip: float | None) -> str:
    """Both mistakes, each with its number, and what the clip did to the update."""
    m = summed.mean_vs_reference
    text = (f"Step {step}: before the clip, the gradient is {summed.factor:.4g}x the mean of "
            f"{summed.basis}, i.e. their sum: the loss is not divided by accumulation_steps "
            f"(K={K}).")
    if not summed.weighting_differs:
        return text + (f" That mean is the reference (norm ratio {m.ratio:.4g}, cosine "
                       f"{m.cosine:.5f}): dividing by K makes it match.")
    text += (f" The weighting differs as well: that mean is {m.ratio:.4g}x the reference "
             f"with cosine {m.cosine:.5f}, so micro-batches (or the tokens in them) do not weigh "
             "what they weigh in the reference")
    ratios = summed.per_microbatch_ratio
    if ratios and any(abs(r - 1) > thresholds.RATIO_NEAR_ONE
                      or c < thresholds.SAME_DIRECTION_COSINE
                      for r, c in zip(ratios, summed.per_microbatch_cosine, strict=False)):
        text += (" -- already within one micro-batch (the loop alone on each is "
                 + ", ".join(f"{r:.3g}x" for r in ratios) + " its reference, cosine "
                 + ", ".join(f"{c:.4f}" for c in summed.per_microbatch_cosine) + ")")
    text += "."
    if clip_norm is not None and max_norm is not None and after_clip is not None \
            and math.isfinite(clip_norm) and clip_norm > max_norm:
        text += (f" The clip bit (total norm {clip_norm:.4g} > {max_norm:g}), so the update is "
                 f"{after_clip:.4g}x the reference, not {K}x: dividing by K alone will not make "
                 "it match.")
    else:
        text += " Dividing by K alone will not make it match."
    return text


#: The fix when the weighting differs too: dividing by K alone leaves the weighting wrong.
FIX = ("Normalise the whole optimizer step once, the way the reference does: for a token- or "
       "sample-weighted loss, sum each micro-batch's per-token (per-sample) losses and divide "
       "by the count over all K micro-batches of the step (no further / K); for a loss that "
       "weighs micro-batches equally, compute it as the reference's `loss` does and divide it "
       "by accumulation_steps.")


def evidence(summed: Summed) -> Evidence:
    m = summed.mean_vs_reference
    out: Evidence = {"measured": compare._round(summed.factor),
                           "factor": compare._round(summed.factor),
                           "weighting_ratio": compare._round(m.ratio),
                           "weighting_cosine": compare._round(m.cosine)}
    if summed.per_microbatch_ratio:
        out["per_microbatch_ratio"] = summed.per_microbatch_ratio
        out["per_microbatch_cosine"] = summed.per_microbatch_cosine
    return out


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double())) / max(
        float(torch.linalg.vector_norm(b.double())), 1e-30)
