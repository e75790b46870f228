"""What the loop meant, reproduced for the fp32 reference (DESIGN §3a, "reference").

The teacher-forced reference gradient itself is computed by the session (`Session.reference`):
the micro-batches a step consumed, weighted as the loop weighs them, under the same RNG state per
micro-batch forward. This module owns the rest of what the loop *meant*: how it clipped. The
reference clips the parameters each of the loop's clip calls covered, with its norm type or by
value, at the threshold the loop intended **in true-gradient space**: the number it passed when
its gradients were already unscaled, that number divided by the loss scale when it clipped scaled
gradients with a threshold multiplied by the scale (PyTorch's own clipping test does this), and
never the loop's effective threshold -- a clip before `unscale_` at an unscaled threshold is
referenced at that threshold in true space, so the mismatch shows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ..core import thresholds
from ..maths import compare
from ..probe.callsite import Site
from ..probe.events import Backward, Clip, Event, Unscale, Update


@dataclass(frozen=True)
class ClipCall:
    """One clip the loop made before a step, as the reference mirrors it."""

    site: Site | None
    kind: str                      # "norm" (clip_grad_norm_) or "value" (clip_grad_value_)
    names: tuple[str, ...]         # the parameters it covered
    norm_type: float
    threshold: float               # the number the loop passed
    intended: float                # the threshold in true-gradient space
    scale: float | None            # the loss scale the gradients still carried (None: unscaled)
    total_norm: float | None       # what clip_grad_norm_ returned (in the space it saw)

    @property
    def scaled_threshold(self) -> bool:
        """Clipped scaled gradients at a threshold multiplied by the scale: equivalent."""
        return self.scale is not None and self.intended != self.threshold

    @property
    def seen_true_norm(self) -> float | None:
        """The norm the clip saw, in true-gradient space when it knew it was scaled."""
        if self.total_norm is None or not math.isfinite(self.total_norm):
            return None
        if self.scaled_threshold and self.scale is not None:
            return self.total_norm / self.scale
        return self.total_norm

    @property
    def bit(self) -> bool:
        seen = self.seen_true_norm
        return self.kind == "norm" and seen is not None and seen > self.intended


def attempt_events(window_events: list[Event]) -> list[Event]:
    """The events of the attempt that produced a step: those after the last scaler.update()
    (a loop that retries a skipped window recomputes it after the update)."""
    updates = [i for i, e in enumerate(window_events) if isinstance(e, Update)]
    return window_events[updates[-1] + 1:] if updates else window_events


def clip_calls(names_of: dict[int, str], window_events: list[Event], owner: dict[int, int],
               known_thresholds: set[float]) -> list[ClipCall]:
    """The loop's clip calls before a step, with their intended thresholds.

    `names_of` maps id(param) to its name, `owner` id(param) to its optimizer slot.
    `known_thresholds` are the values the loop is known to mean: the run's `max_grad_norm` and
    what the fp32 run of the loop passed at the same call site.
    """
    events = attempt_events(window_events)
    calls: list[ClipCall] = []
    for position, event in enumerate(events):
        if not isinstance(event, Clip) or event.max_norm is None:
            continue
        ids = event.param_ids
        names = tuple(names_of[i] for i in ids if i in names_of)
        slots = {slot for i in ids if (slot := owner.get(i)) is not None}
        scale = _scale_carried(events[:position], slots)
        threshold = float(event.max_norm)
        intended = threshold
        if scale is not None and scale != 1.0:
            divided = threshold / scale
            if any(abs(divided - t) <= thresholds.SCALED_THRESHOLD_RTOL * t
                   for t in known_thresholds if t):
                intended = divided
        calls.append(ClipCall(event.site, event.clip_kind, names,
                              float(event.norm_type or 2.0), threshold, intended,
                              scale, event.total_norm))
    return calls


def _scale_carried(before: list[Event], slots: set[int]) -> float | None:
    """The loss scale the gradients of these optimizers still carry at this point of the
    attempt: the last scaled backward's scale when no unscale_ of theirs came after it."""
    scale = None
    for e in before:
        if isinstance(e, Backward) and e.scaled_by:
            scale = float(e.scaled_by)
        elif (isinstance(e, Unscale) and e.enabled and not e.inside_step
              and (not slots or e.optimizer in slots)):
            scale = None
    return scale


def _norm(parts: list[torch.Tensor], norm_type: float) -> float:
    """The norm of the parts concatenated (without concatenating them)."""
    parts = [p for p in parts if p.numel()]
    if not parts:
        return 0.0
    if math.isinf(norm_type):
        return max(float(p.abs().max()) for p in parts)
    if norm_type == 2:
        return math.sqrt(sum(compare.sum_of_squares(p) for p in parts))
    total = sum(float(torch.linalg.vector_norm(p.double(), norm_type)) ** norm_type
                for p in parts)
    return total ** (1.0 / norm_type)


#: One clip's effect on one parameter's reference gradient: ("mul", coefficient) or
#: ("clamp", value).
ClipOp = tuple[str, float]


def _applied(tensor: torch.Tensor, ops: list[ClipOp]) -> torch.Tensor:
    """`tensor` (fp32) as the ops leave it; a new tensor only when there are ops."""
    out = tensor
    for op, value in ops:
        out = out * value if op == "mul" else out.clamp(-value, value)
    return out


class ClippedReference(Mapping):
    """The reference gradient as the loop's clips leave it, parameter by parameter: each
    parameter's clipped tensor is made when it is read (no clipped copy of the whole model)."""

    def __init__(self, reference: Mapping[str, torch.Tensor | None],
                 ops: dict[str, list[ClipOp]]):
        self.reference, self.ops = reference, ops

    def __getitem__(self, name: str) -> torch.Tensor | None:
        tensor = self.reference[name]
        ops = self.ops.get(name)
        return tensor if tensor is None or not ops else _applied(tensor.float(), ops)

    def __iter__(self) -> Iterator[str]:
        return iter(self.reference)

    def __len__(self) -> int:
        return len(self.reference)


def norm_of(reference: Mapping[str, torch.Tensor | None], names: Iterable[str], norm_type: float,
            ops: dict[str, list[ClipOp]] | None = None) -> float:
    """The norm of the reference over `names` (a missing or None gradient is zeros), with the
    clip ops applied when given (`_norm` over the parts: no flattened copy)."""
    parts = []
    for name in names:
        tensor = reference.get(name)
        if tensor is not None:
            parts.append(_applied(tensor.float(), (ops or {}).get(name, [])).reshape(-1))
    return _norm(parts, norm_type)


def clip_ops(reference: Mapping[str, torch.Tensor | None], names: list[str],
             calls: list[ClipCall]) -> tuple[ClippedReference, list[float | None]]:
    """The reference over `names` clipped the way the loop meant, parameter by parameter, and
    each call's coefficient (None for a value clip). The calls apply in order, each norm
    measured on what the calls before it left."""
    ops: dict[str, list[ClipOp]] = {name: [] for name in names}
    coefficients: list[float | None] = []
    for call in calls:
        covered = [n for n in call.names if n in ops]
        if not covered:
            coefficients.append(None)
            continue
        if call.kind == "value":
            for name in covered:
                ops[name].append(("clamp", call.intended))
            coefficients.append(None)
            continue
        norm = norm_of(reference, covered, call.norm_type, ops)
        coef = min(1.0, call.intended / (norm + thresholds.CLIP_EPSILON))
        if coef != 1.0:
            for name in covered:
                ops[name].append(("mul", coef))
        coefficients.append(coef)
    view = {name: reference.get(name) for name in names}
    return ClippedReference(view, ops), coefficients


def reference_norm(reference: Mapping[str, torch.Tensor | None], call: ClipCall) -> float:
    """The reference's unclipped norm over the parameters one clip call covered (each once)."""
    return norm_of(reference, list(dict.fromkeys(call.names)), call.norm_type)

