"""The kind of a clip in scaled space: `clip-before-unscale`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from ..enums import KindId
from ..findings import Finding
from .base import Kind, Observed

CLIP_BEFORE_UNSCALE = Kind(
    KindId.CLIP_BEFORE_UNSCALE,
    title="Gradients are clipped while still scaled",
    why=(
        "`clip_grad_norm_` runs before `scaler.unscale_`, so it sees gradients multiplied by the "
        "loss "
        "scale S: the threshold is effectively max_norm*S in true-gradient space, or the update is "
        "crushed by 1/S."),
    fix=(
        "Call `scaler.unscale_(optimizer)` right before `torch.nn.utils.clip_grad_norm_(model."
        "parameters(), max_norm)`, then `scaler.step(optimizer)` (it does not unscale again). A "
        "norm computed by hand for clipping or logging must also come after `unscale_`."),
    example=(
        "scaler.scale(loss).backward()\n"
        "if (i + 1) % K == 0:\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # grads x S\n"
        "    scaler.step(optimizer)              # unscales, too late for the clip\n"
        "    scaler.update()\n"
        "    optimizer.zero_grad()"),
    error_when=(
        "a clip in scaled space shrank the update by another factor than the same threshold "
        "in true space: the update differs. Warning: the clip has not bitten yet (the update "
        "matched), or it clips at the threshold times the scale (the same update)."),
    measured="norm the clip saw / true norm (the loss scale S)",
    decided_in=f"{__name__}:clip_before_unscale",
)


def clip_before_unscale(seen: Observed) -> Finding:
    """`clip-before-unscale`: gradients are clipped while still scaled.
    Error: the scaled-space clip changed the update; warning: it has not bitten yet.
    (`CLIP_BEFORE_UNSCALE.error_when`)"""
    return Finding(seen.rung, KindId.CLIP_BEFORE_UNSCALE, seen.severity,
                   **seen.fields(CLIP_BEFORE_UNSCALE))
