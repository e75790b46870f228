"""The kinds of the skips rung: what a skipped step leaves behind: `no-zero-grad-after-skip`.

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

NO_ZERO_GRAD_AFTER_SKIP = Kind(
    KindId.NO_ZERO_GRAD_AFTER_SKIP,
    title="Gradients are not cleared after a skipped step",
    why=(
        "After GradScaler skipped a step, the inf/NaN gradients stay in `.grad` and poison the "
        "next "
        "window, which is skipped too; a hand-written overflow guard that `continue`s past "
        "`scaler.update()` also makes torch refuse the next `unscale_()`."),
    fix=(
        "Run `scaler.update()` and `optimizer.zero_grad(set_to_none=True)` after every "
        "`scaler.step`, skipped or not; drop a hand-written `if not torch.isfinite(norm): "
        "continue` (scaler.step already skips non-finite steps) or make it clear the gradients "
        "and update the scaler too."),
    example=(
        "scaler.unscale_(optimizer)\n"
        "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "if not torch.isfinite(norm):\n"
        "    continue              # skips update() and zero_grad(): inf stays\n"
        "scaler.step(optimizer)\n"
        "scaler.update()\n"
        "optimizer.zero_grad()"),
    error_when=(
        "after the injected overflow the next window(s) were skipped too (updates dropped), or "
        "the loop's own skip path left the inf in .grad and torch refused the next unscale_. "
        "Warning: in a run forced into fp16."),
    measured="windows skipped after the injected one",
    decided_in=f"{__name__}:no_zero_grad_after_skip",
)


def no_zero_grad_after_skip(seen: Observed) -> Finding:
    """`no-zero-grad-after-skip`: gradients are not cleared after a skipped step.
    Error: windows after the injected overflow skipped too (`skip_severity`).
    (`NO_ZERO_GRAD_AFTER_SKIP.error_when`)"""
    return Finding(seen.rung, KindId.NO_ZERO_GRAD_AFTER_SKIP, seen.severity,
                   **seen.fields(NO_ZERO_GRAD_AFTER_SKIP))
