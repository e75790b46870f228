"""The kinds of the skips rung: what a skipped step leaves behind: `no-zero-grad-after-skip`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.enums import KindId
from ..core.findings import Finding, Location
from .base import FORCED_FP16, Kind, Observed, skip_severity

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


@dataclass(frozen=True)
class SkippedAfterInjection:
    """What the skips rung counted after the overflow it injected into one window: the windows
    right after it that were skipped too while the plain fp16 run updated in them."""

    rung: str
    injected_window: int
    skipped_after: int                  # windows skipped in a row after the injected one
    applied_windows: tuple[int, ...]    # the windows whose update was applied
    skipped: tuple[bool, ...]           # skipped or not, per scaler.step of the run
    own_scaler: bool = True             # the user's own precision uses a GradScaler
    location: Location | None = None    # the last zero_grad, else the last scaler.step


def skipped_after_injection(o: SkippedAfterInjection) -> Finding | None:
    """`no-zero-grad-after-skip` when the injected inf poisoned the following window(s): an
    error in a run whose own precision uses a GradScaler (`skip_severity`), None when the next
    window updated."""
    if o.skipped_after <= 0:
        return None
    return no_zero_grad_after_skip(Observed(o.rung,
        skip_severity(True, own_scaler=o.own_scaler),
        f"After the injected overflow in window {o.injected_window} the next {o.skipped_after} "
        "window(s) were skipped too: the inf stayed in .grad and poisoned the following "
        "window(s). Gradients must be cleared after a skipped step as after a good one."
        + ("" if o.own_scaler else FORCED_FP16),
        evidence={"measured": o.skipped_after, "expected": 0,
                  "injected_window": o.injected_window,
                  "applied_windows": sorted(o.applied_windows), "skipped": list(o.skipped)},
        location=o.location))


@dataclass(frozen=True)
class SkipPathLeftOpen:
    """A hand-written overflow guard the injected inf sent the loop down, which left the step
    without scaler.update() and zero_grad(): torch refused the next window's unscale_()."""

    rung: str
    param_name: str | None              # the parameter whose .grad got the inf
    error: str                          # torch's refusal
    own_scaler: bool = True
    location: Location | None = None


def skip_path_left_open(o: SkipPathLeftOpen) -> Finding:
    """`no-zero-grad-after-skip` for a skip path that kept the inf: the next window could not
    update (torch refused it), an error in a run whose own precision uses a GradScaler."""
    return no_zero_grad_after_skip(Observed(o.rung,
        skip_severity(True, own_scaler=o.own_scaler),
        f"An inf injected into {o.param_name}.grad sent the loop down its own skip path, "
        "which left the step without scaler.update() and without zero_grad(): the inf stayed in "
        ".grad and torch refused the next window's unscale_() "
        f"({o.error}). On a skip, clear the gradients and call "
        "scaler.update() as after a good step -- or drop the hand-written check and let "
        "scaler.step() skip." + ("" if o.own_scaler else FORCED_FP16),
        evidence={"measured": 0, "expected": 1, "zero_grad_on_skip_path": 0,
                  "update_on_skip_path": 0, "error": o.error},
        location=o.location))
