"""(g_user, g_ref) -> a verdict with numbers. Pure maths on dicts of tensors; no probe here.

The comparison is teacher-forced (DESIGN §1): each optimizer step's consumed gradient is
compared with the fp32 reference gradient at the same parameters on the data that step should
have used. When they differ, `classify` tests the known shapes: each hypothesis builds the
gradient a particular mistake would produce from the same per-micro-batch gradients, and the
one that matches the user's gradient names the kind. Ratios alone are ambiguous (a factor 4 is
"no average" when K = 4 and "sum reduction" when b = 4); whole-vector hypotheses are not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..core import thresholds
from ..core.enums import KindId
from ..core.evidence import Evidence, significant
from . import shards

#: Gradients (or weights) by parameter name; read only here.
Grads = Mapping[str, "torch.Tensor | None"]


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


class _DefaultTolerances(Mapping[str, Tolerance]):
    """Each precision's default tolerance, read from `thresholds` at every lookup (the numbers
    and their reason are there)."""

    def _all(self) -> dict[str, Tolerance]:
        return {"fp32": Tolerance(thresholds.FP32_RTOL, thresholds.FP32_ATOL),
                "bf16": Tolerance(thresholds.BF16_RTOL, thresholds.BF16_ATOL),
                "fp16": Tolerance(thresholds.FP16_RTOL, thresholds.FP16_ATOL)}

    def __getitem__(self, precision: str) -> Tolerance:
        return self._all()[precision]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


#: precision -> its default `Tolerance` (thresholds.FP32_RTOL and the others).
DEFAULT_TOLERANCES: Mapping[str, Tolerance] = _DefaultTolerances()


def is_precision_noise(m: Metrics, precision: str) -> bool:
    """Beyond tolerance but shaped like rounding, not like a bug.

    bf16/fp16 gradients of conv nets with BatchNorm on micro-batches of a few samples differ from
    fp32 by 5-10 % (measured), while every AMP mistake ampdoctor knows moves the gradient by a
    factor (K, 1/K, b, S, 1/S) or turns it (cosine well below thresholds.NOISE_MIN_COSINE). A
    same-direction, same-size gradient in a reduced precision is noise; in fp32 nothing is.
    """
    low, high = thresholds.NOISE_RATIO_BAND
    return (precision != "fp32" and m.cosine >= thresholds.NOISE_MIN_COSINE
            and low <= m.ratio <= high)


def hypothesis_tolerance(rtol: float) -> float:
    """How close (relative) a gradient must be to a hypothesis to be named by it, at a
    precision's `rtol` (thresholds.RTOL_MULTIPLE, thresholds.HYPOTHESIS_RTOL_FLOOR)."""
    return max(thresholds.RTOL_MULTIPLE * rtol, thresholds.HYPOTHESIS_RTOL_FLOOR)


def flatten(grads: Grads, names: Sequence[str], shapes: dict[str, torch.Size]) -> torch.Tensor:
    parts = []
    for name in names:
        g = grads.get(name)
        if g is None:
            parts.append(torch.zeros(shapes[name]).flatten())
        else:
            parts.append(g.detach().float().flatten().cpu())
    return torch.cat(parts) if parts else torch.zeros(0)


@dataclass
class Metrics:
    rel_err: float
    ratio: float
    cosine: float
    norm_user: float
    norm_ref: float
    ok: bool
    allowed: float

    def as_evidence(self) -> Evidence:
        return {"ratio": _round(self.ratio), "cosine": _round(self.cosine),
                "relative_error": _round(self.rel_err), "norm_user": _round(self.norm_user),
                "norm_reference": _round(self.norm_ref)}


_round = significant


#: Sums of squares and dot products run over chunks of this many elements, each chunk copied
#: into a reused float64 buffer and reduced there, the chunks' results added in Python floats:
#: the float64 answer on every CPU and BLAS (a float32 dot of a 1M-element chunk is off by
#: 1e-7 to 4e-6 relative depending on how the BLAS orders its sums), with no model-sized
#: float64 copy (two chunk-sized buffers). Few, large calls: on a loaded machine every
#: multi-threaded call pays for its threads' barrier.
CHUNK = 1 << 20


def _buffers(count: int, numel: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(min(CHUNK, numel), dtype=torch.float64, device=device)
            for _ in range(count)]


def sum_of_squares(vector: torch.Tensor) -> float:
    """The squared 2-norm of a vector of any size, accumulated in float64 (see CHUNK)."""
    v = vector.detach().reshape(-1)
    (buffer,) = _buffers(1, v.numel(), v.device)
    total = 0.0
    for c in v.split(CHUNK):
        b = buffer[:c.numel()].copy_(c)
        total += float(torch.dot(b, b))
    return total


def norm2(vector: torch.Tensor) -> float:
    """The 2-norm of a vector of any size, accumulated in float64 (see CHUNK)."""
    return math.sqrt(sum_of_squares(vector))


def same_tensors(a: Mapping[str, torch.Tensor | None],
                 b: Mapping[str, torch.Tensor | None] | None) -> bool:
    """The same keys, and under each a plain tensor equal in shape, dtype and every element
    (a state dict against another, e.g. the initial weights)."""
    if b is None or a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if (type(value) is not torch.Tensor or type(other) is not torch.Tensor
                or value.shape != other.shape or value.dtype != other.dtype
                or not torch.equal(value.to(other.device), other)):
            return False
    return True


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a strided tensor: a sparse gradient (an `nn.Embedding(sparse=True)`'s, for
    `SparseAdam`) densified, so that it is compared, normed and copied like any other."""
    return tensor.to_dense() if tensor.layout != torch.strided else tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """No inf and no NaN in `tensor`: min/max propagate both (one reduction, no mask), and
    x * 0 is 0 for a finite x, NaN for inf or NaN (one read: one host sync on a GPU)."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor.detach().reshape(-1))
    return float(low * 0 + high * 0) == 0


def _chunked(user: torch.Tensor, ref: torch.Tensor
             ) -> tuple[tuple[float, float, float], float]:
    """The squared norms of user, ref and user - ref, and dot(user, ref), chunk by chunk in
    float64 (see CHUNK)."""
    su = sr = sd = dot = 0.0
    user, ref = user.detach().reshape(-1), ref.detach().reshape(-1)
    ub, rb = _buffers(2, user.numel(), user.device)
    for u, r in zip(user.split(CHUNK), ref.split(CHUNK), strict=False):
        a, b = ub[:u.numel()].copy_(u), rb[:r.numel()].copy_(r)
        su += float(torch.dot(a, a))
        sr += float(torch.dot(b, b))
        dot += float(torch.dot(a, b))
        a.sub_(b)
        sd += float(torch.dot(a, a))
    return (su, sr, sd), dot


def metrics_of(user: Grads, ref: Grads, names: Sequence[str], shapes: dict[str, torch.Size],
               tol: Tolerance) -> Metrics:
    """`metrics` of the two gradients flattened over `names` (`flatten`: a missing or None
    gradient is zeros), computed tensor by tensor: no flat copy of either is made.

    A user gradient that is a rank's piece of a sharded one (`shards.piece`) is compared with
    the same piece of the reference, and the sums over every rank's piece are added up
    (`shards.all_sum`): the numbers of the whole, each rank holding its own piece only. Every
    rank of the sharded run then makes the same calls (the judge walks the same steps)."""
    su = sr = sd = dot = 0.0
    numel = 0
    pieces = [0.0, 0.0, 0.0, 0.0]    # sums over this rank's pieces, added up over the ranks
    replicas = 0
    for name in names:
        numel += math.prod(shapes[name])
        u, r = user.get(name), ref.get(name)
        place = shards.place_of(u)
        if place is not None and u is not None:
            replicas = place.replicas
            here = shards.region(r, place, u.shape) if r is not None else torch.zeros_like(u)
            (a, b, c), d = _chunked(u.detach().cpu(), here.detach().cpu())
            pieces = [pieces[0] + a, pieces[1] + b, pieces[2] + c, pieces[3] + d]
            continue
        if u is None and r is None:
            continue
        if u is None or r is None:   # against zeros: the difference is the other one
            present = u if r is None else r
            assert present is not None
            squares = sum_of_squares(present.detach().cpu())
            sd += squares
            if r is None:
                su += squares
            else:
                sr += squares
            continue
        (a, b, c), d = _chunked(u.detach().cpu(), r.detach().cpu())
        su, sr, sd, dot = su + a, sr + b, sd + c, dot + d
    if replicas:
        a, b, c, d = shards.all_sum(pieces, replicas)
        su, sr, sd, dot = su + a, sr + b, sd + c, dot + d
    return metrics_from(math.sqrt(su), math.sqrt(sr), math.sqrt(sd), lambda: dot, numel, tol)


def metrics(user: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Metrics:
    if user.numel() != ref.numel():
        raise ValueError(f"cannot compare vectors of {user.numel()} and {ref.numel()} elements")
    (su, sr, sd), dot = _chunked(user, ref)
    return metrics_from(math.sqrt(su), math.sqrt(sr), math.sqrt(sd), lambda: dot, ref.numel(),
                        tol)


def metrics_from(norm_u: float, norm_r: float, diff: float, dot: Callable[[], float], numel: int,
                 tol: Tolerance) -> Metrics:
    """The metrics of two vectors of `numel` elements from their norms, the norm of their
    difference and (called only when both norms are positive) their dot product."""
    allowed = tol.rtol * norm_r + tol.atol * math.sqrt(max(numel, 1))
    rel = diff / norm_r if norm_r > 0 else (0.0 if diff == 0 else math.inf)
    if norm_u > 0 and norm_r > 0:
        cosine = dot() / (norm_u * norm_r)
    else:
        cosine = 1.0 if norm_u == norm_r else 0.0
    ratio = norm_u / norm_r if norm_r > 0 else (1.0 if norm_u == 0 else math.inf)
    finite = math.isfinite(diff)
    return Metrics(rel, ratio, cosine, norm_u, norm_r, finite and diff <= allowed, allowed)


def clip_vector(vector: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """What clip_grad_norm_ (norm 2) makes of a gradient: same formula, same epsilon."""
    if max_norm is None or not math.isfinite(max_norm):
        return vector
    norm = float(torch.linalg.vector_norm(vector.double()))
    coef = max_norm / (norm + thresholds.CLIP_EPSILON)
    return vector * min(coef, 1.0)


@dataclass
class Hypothesis:
    kind: str
    label: str
    vector: torch.Tensor
    factor: float | None = None
    extra: Evidence = field(default_factory=lambda: Evidence())


@dataclass
class Classification:
    kind: str
    label: str
    rel_err: float
    factor: float | None
    extra: Evidence


def window_hypotheses(per_mb: list[torch.Tensor], counts: list[float], weighted: bool,
                      reference: torch.Tensor, accumulation_steps: int,
                      contributing_from: int | None = None) -> list[Hypothesis]:
    """The gradients the known accumulation mistakes would produce on this window.

    per_mb[k] is micro-batch k's own mean gradient (its loss normalised over its own samples or
    tokens); counts[k] its sample count, or token/sample weight when the loss is weighted.
    """
    K = accumulation_steps
    equal = torch.stack(per_mb).mean(0)
    total_count = sum(counts)
    sums = [g * n for g, n in zip(per_mb, counts, strict=False)]
    summed = torch.stack(sums).sum(0)
    out = [
        Hypothesis(KindId.MISSING_ACCUMULATION_AVERAGE, f"sum of the {K} micro-batch gradients "
                   "(loss not divided by K)", equal * K, float(K)),
        Hypothesis(KindId.DOUBLE_AVERAGE, f"the step gradient divided by K={K} once more",
                   reference / K, 1.0 / K),
        Hypothesis(KindId.DOUBLE_AVERAGE, f"the equal-weight mean divided by K={K} once more",
                   equal / K, 1.0 / K),
        Hypothesis(KindId.REDUCTION_MISMATCH,
                   "per-sample sum divided by K (reduction='sum' with / K)",
                   summed / K, total_count / K),
        Hypothesis(KindId.REDUCTION_MISMATCH,
                   "per-sample sum not averaged at all (reduction='sum')",
                   summed, total_count),
    ]
    if weighted:
        out.append(Hypothesis(KindId.WEIGHTED_AVERAGE_MISMATCH,
                              "equal-weight mean of the per-micro-batch weighted means",
                              equal, None, {"weights": [_round(c) for c in counts]}))
    else:
        # Without weights known to ampdoctor (loop-as-reference mode), an equal-weight mean that
        # differs from the whole-step gradient still means the loop weights micro-batches equally.
        out.append(Hypothesis(KindId.WEIGHTED_AVERAGE_MISMATCH,
                              "equal-weight mean of the per-micro-batch means", equal, None))
    # zero_grad inside the window: only micro-batches j..K-1 reach the step.
    starts = range(1, K) if contributing_from is None else [contributing_from]
    for j in starts:
        if not 0 < j < K:
            continue
        tail_eq = torch.stack(per_mb[j:]).sum(0) / K
        tail_plain = torch.stack(per_mb[j:]).sum(0)
        label = f"only micro-batches {j}..{K - 1} of the window"
        extra: Evidence = {"contributing_microbatches": K - j}
        out.append(Hypothesis(KindId.ZERO_GRAD_INSIDE_ACCUMULATION, label + " (each / K)", tail_eq,
                              None, extra))
        out.append(Hypothesis(KindId.ZERO_GRAD_INSIDE_ACCUMULATION, label, tail_plain, None, extra))
        if weighted and total_count > 0:
            tail_w = torch.stack(sums[j:]).sum(0) / total_count
            out.append(Hypothesis(KindId.ZERO_GRAD_INSIDE_ACCUMULATION, label + " (weighted)",
                                  tail_w, None, extra))
    return out


def implied_weights(full: torch.Tensor, per_mb: list[torch.Tensor]) -> list[float] | None:
    """The weights (summing to 1) with which the micro-batch gradients combine into the
    whole-window reference, by least squares: equal when each micro-batch counts as much as the
    others, proportional to its tokens when the loss averages over the window's tokens."""
    if not per_mb:
        return None
    columns = torch.stack([g.double() for g in per_mb], dim=1)
    solution = torch.linalg.lstsq(columns, full.double().unsqueeze(1)).solution.squeeze(1)
    total = float(solution.sum())
    if not math.isfinite(total) or total == 0:
        return None
    return [_round(float(w) / total) for w in solution]


def scale_hypotheses(reference: torch.Tensor, scale: float | None) -> list[Hypothesis]:
    """The fp16 shapes: a step on still-scaled gradients, or gradients divided by S twice."""
    if not scale or scale == 1.0:
        return []
    return [
        Hypothesis(KindId.MISSING_UNSCALE, f"the reference times the loss scale S={scale:g}",
                   reference * scale, scale),
        Hypothesis(KindId.UNSCALE_TWICE, f"the reference divided by the loss scale S={scale:g}",
                   reference / scale, 1.0 / scale),
    ]


def classify(user: torch.Tensor, reference: torch.Tensor, hypotheses: list[Hypothesis],
             tolerance: float) -> Classification | None:
    """The hypothesis closest to the user's gradient, if it is within `tolerance`."""
    best: Classification | None = None
    ref_norm = float(torch.linalg.vector_norm(reference.double()))
    for hyp in hypotheses:
        target = hyp.vector.double()
        norm_t = float(torch.linalg.vector_norm(target))
        if norm_t == 0:
            continue
        # A hypothesis that coincides with the reference explains nothing.
        if float(torch.linalg.vector_norm(target - reference.double())) <= tolerance * ref_norm:
            continue
        err = float(torch.linalg.vector_norm(user.double() - target)) / norm_t
        if err <= tolerance and (best is None or err < best.rel_err):
            best = Classification(hyp.kind, hyp.label, err, hyp.factor, hyp.extra.copy())
    return best


def nearest_integer_factor(ratio: float, base: float) -> int | None:
    """If ratio is an integer multiple m >= 1 of base (to thresholds.COUNT_RATIO_RTOL, 1 %),
    return m."""
    if base <= 0 or not math.isfinite(ratio):
        return None
    m = round(ratio / base)
    if m >= 1 and abs(ratio / base - m) <= thresholds.COUNT_RATIO_RTOL * m:
        return m
    return None
