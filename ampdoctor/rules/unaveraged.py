"""A window that sums its micro-batches' gradients (no division by K) while its weighting also
differs from the reference's: two mistakes in one gradient.

The factor K is read from the gradient *before* any clip (a clip that bites rescales the whole
gradient, so the update's ratio to the reference is no longer K), and against the combination
of micro-batch gradients the loop actually used, not against the reference: the reference
weighs micro-batches (and tokens within them) its own way, so its norm ratio to the loop's
gradient is K times a weighting factor of no fixed size. The weighting difference is then what
is left between that combination, averaged, and the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.evidence import Evidence
from ..kinds.accumulation import Unaveraged
from ..maths import compare
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


def measured(summed: Summed) -> Unaveraged:
    """The numbers of `summed` for its kind's unit to word (kinds.accumulation)."""
    m = summed.mean_vs_reference
    return Unaveraged(summed.factor, summed.basis, summed.weighting_differs, m.ratio, m.cosine,
                      tuple(summed.per_microbatch_ratio), tuple(summed.per_microbatch_cosine))


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
