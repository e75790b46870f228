"""The kind of a clip in scaled space: `clip-before-unscale`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core import thresholds
from ..core.enums import KindId, Severity
from ..core.evidence import Evidence, significant
from ..core.findings import Finding, Location
from .base import SCAN_RUNG, Kind, Observed, call_order_verdict, in_framework_terms

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
    matched=(
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient = {label}: the "
        "gradients were clipped against a norm taken before unscale_, in scaled space."),
    words_its_clip=True,
    framework_fixes={
        "Lightning":
            "Lightning unscales only inside the optimizer step: a clip in `on_after_backward`, "
            "or between `self.manual_backward(loss)` and `opt.step()` (a `clip_grad_norm_`, or "
            "`self.clip_gradients(...)` where Lightning's manual-optimization guide places it; "
            "Lightning-AI/pytorch-lightning#18089), sees scaled gradients under 16-mixed. With "
            "automatic optimization set `gradient_clip_val` on the Trainer; with manual "
            "optimization clip in `on_before_optimizer_step(self, optimizer)`, which Lightning "
            "calls after the unscale.",
    },
)


def clip_before_unscale(seen: Observed) -> Finding:
    """`clip-before-unscale`: gradients are clipped while still scaled.
    Error: the scaled-space clip changed the update; warning: it has not bitten yet.
    (`CLIP_BEFORE_UNSCALE.error_when`)"""
    seen = in_framework_terms(CLIP_BEFORE_UNSCALE, seen)
    return Finding(seen.rung, KindId.CLIP_BEFORE_UNSCALE, seen.severity,
                   **seen.fields(CLIP_BEFORE_UNSCALE))


@dataclass(frozen=True)
class ScaledClip:
    """A clip the step state machine saw on gradients still multiplied by the loss scale: the
    norm the clip saw and the true norm of the window's reference, its threshold, whether it
    clipped by value, and, with several optimizers, the one not unscaled and the others that
    were. `update_matched`: every fp16 update matched the reference (the clip has not bitten
    yet)."""

    kind: ClassVar[KindId] = KindId.CLIP_BEFORE_UNSCALE
    rung: str
    window: int
    scale: float | None
    norm_seen: float | None
    true_norm: float | None
    max_norm: Any
    by_value: bool = False
    optimizer: int | None = None
    optimizers: int = 1
    unscaled_others: tuple[int, ...] = ()
    location: Location | None = None
    update_matched: bool = False
    unmeasured: bool = False            # no reference run compared the update (a script)

    @property
    def never_clips(self) -> bool:
        """A norm clip at an infinite threshold: a norm read (for logging), not a clip."""
        try:
            return not self.by_value and not math.isfinite(float(self.max_norm))
        except (TypeError, ValueError):
            return False


def scaled_clip(o: ScaledClip) -> Finding:
    """`clip-before-unscale` from the state machine: an error where it explains a mismatch the
    judge found; a warning (`update_matched`) while every update still matched."""
    seen, true = o.norm_seen, o.true_norm
    ratio = (seen / true) if seen and true else None
    if o.by_value:
        # clip_grad_value_ returns nothing: the threshold is off by the scale itself.
        ratio = o.scale
    evidence: Evidence = {"scale": o.scale, "window": o.window,
                          "measured": significant(ratio) if ratio else None,
                          "expected": 1.0, "norm_seen_by_clip": seen,
                          "true_norm": significant(true) if true else None,
                          "max_grad_norm": o.max_norm}
    if o.never_clips:
        return clip_before_unscale(Observed(o.rung, Severity.WARNING,
            "clip_grad_norm_ ran before scaler.unscale_ with an infinite max_norm: it never "
            "clips, so the update is not affected, but the norm it returned (a logged "
            "grad_norm) is the scaled one"
            + (f": {seen:.6g} where the true norm is {true:.6g}, {ratio:.6g}x, the loss scale "
               f"({o.scale:g})." if ratio and seen and true else "."),
            evidence=evidence, location=o.location,
            fix="Read the norm after `scaler.unscale_(optimizer)` (unscale first, then "
                "`clip_grad_norm_`, then `scaler.step(optimizer)`, which does not unscale "
                "again), or divide it by `scaler.get_scale()` before logging it."))
    if o.by_value:
        message = (f"clip_grad_value_ ran before scaler.unscale_: the clip value "
                   f"{o.max_norm} was applied to gradients multiplied by the "
                   f"loss scale {o.scale:g}, i.e. a clip value {o.scale:g}x too small in "
                   "true-gradient space.")
    elif ratio and seen and true:
        message = (f"clip_grad_norm_ ran before scaler.unscale_: it saw a gradient norm "
                   f"of {seen:.6g} where the true norm is {true:.6g} — a ratio "
                   f"of {ratio:.6g}, the loss scale ({o.scale:g}). The threshold "
                   f"{o.max_norm} was applied in scaled space.")
    else:
        message = "clip_grad_norm_ ran before scaler.unscale_ on scaled gradients."
    if o.optimizers > 1 and o.optimizer is not None:
        evidence["optimizer"] = o.optimizer
        unscaled = sorted(o.unscaled_others)
        message += (f" Optimizer {o.optimizer} (of {o.optimizers}) had not been "
                    "unscaled" + (f" although optimizer(s) {unscaled} had: the clip "
                                  "mixed scaled and true gradients" if unscaled else "")
                    + f"; call scaler.unscale_() on optimizer {o.optimizer} before clipping.")
    severity, text = call_order_verdict(
        message, "it clipped gradients still multiplied by the loss scale; it has not bitten "
        "yet, but once the scale grows (or the gradients do) the threshold acts on S x the true "
        "norm and the update shrinks by 1/S",
        update_matched=o.update_matched, unmeasured=o.unmeasured)
    return clip_before_unscale(Observed(o.rung, severity, text, evidence=evidence,
                                        location=o.location))


@dataclass(frozen=True)
class ClipInScaledSpace:
    """The judge's bad step had a clip on gradients still multiplied by the loss scale, at a
    threshold the loop means in true space: the norm the clip saw, the true norm, the scale,
    the threshold, whether it clipped by value, the update/reference ratio and the comparison
    numbers (`metrics`)."""

    rung: str
    step: int
    window: int
    scale: float
    threshold: float
    norm_seen: float | None
    true_norm: float
    ratio: float
    metrics: Evidence
    tolerance: float
    by_value: bool = False
    location: Location | None = None


def clip_in_scaled_space(o: ClipInScaledSpace) -> Finding:
    """`clip-before-unscale` that changed the update (an error): the threshold met S x the
    true norm."""
    seen, true = o.norm_seen, o.true_norm
    evidence: Evidence = {
        "measured": significant(seen / true) if seen and true else None,
        "expected": 1.0, "scale": o.scale, "norm_seen_by_clip": seen,
        "true_norm": significant(true), "max_grad_norm": o.threshold,
        "step": o.step, "window": o.window, **o.metrics, "tolerance": o.tolerance}
    if o.by_value:
        evidence["measured"] = o.scale
        message = (f"Step {o.step}: clip_grad_value_ ran before scaler.unscale_: the clip "
                   f"value {o.threshold:g} was applied to gradients multiplied by the loss "
                   f"scale {o.scale:g}, i.e. a clip value {o.scale:g}x too small in "
                   f"true-gradient space; the update is {o.ratio:.4g}x the reference.")
    else:
        message = (f"Step {o.step}: clip_grad_norm_ ran before scaler.unscale_: it saw a "
                   f"gradient norm of {seen:.6g} where the true norm is {true:.6g} (the "
                   f"loss scale {o.scale:g}), so the threshold {o.threshold:g} was applied "
                   f"in scaled space and the update is {o.ratio:.4g}x the reference clipped at "
                   f"{o.threshold:g}.")
    return clip_before_unscale(Observed(o.rung, Severity.ERROR, message, evidence=evidence,
                                        location=o.location))


@dataclass(frozen=True)
class WatchedScaledClip:
    """The sentinel saw clip_grad_norm_ run before scaler.unscale_ in a real training: the norm
    it saw, the loss scale, the threshold."""

    rung: str
    step: int
    norm_seen: float
    scale: float
    max_norm: float
    location: Location | None = None
    framework: str | None = None         # the framework driving the training (its fix)


def watched_scaled_clip(o: WatchedScaledClip) -> Finding:
    """`clip-before-unscale` in a real training: an error once the clip bites (the update
    shrank against the one clipped in true space), a warning while it does not."""
    true = o.norm_seen / o.scale
    bites = o.norm_seen > o.max_norm
    message = (f"Optimizer step {o.step}: clip_grad_norm_ ran before "
               f"scaler.unscale_: it saw a gradient norm of {o.norm_seen:.6g} where the true "
               f"norm is {true:.6g} (the loss scale {o.scale:g}), so the threshold "
               f"{o.max_norm:g} was applied in scaled space"
               + (" and the update shrank to "
                  f"{min(1.0, o.max_norm / o.norm_seen) / min(1.0, o.max_norm / true):.3g}x "
                  "the one clipped in true space." if bites else "."))
    return clip_before_unscale(Observed(
        o.rung, Severity.ERROR if bites else Severity.WARNING, message,
        evidence={"measured": round(o.norm_seen / max(true, 1e-30), 6), "expected": 1.0,
                  "scale": o.scale, "norm_seen_by_clip": round(o.norm_seen, 6),
                  "true_norm": round(true, 6), "max_grad_norm": o.max_norm, "step": o.step,
                  **({"framework": o.framework} if o.framework else {})},
        location=o.location))


@dataclass(frozen=True)
class ScriptScaledClip:
    """A script's clip saw the gradient norm times the loss scale (read from the run alone, no
    reference): the norm it saw, the scale, its threshold."""

    rung: str
    norm_seen: float
    scale: float
    max_norm: float
    location: Location | None = None


def script_scaled_clip(o: ScriptScaledClip) -> Finding:
    """`clip-before-unscale` in a script: an error when the clip coefficient in scaled space
    shrinks the update by more than a biting clip does against the one the threshold gives in
    true space (`CLIP_BITES_BELOW`), a warning while it is the same update."""
    seen = min(1.0, o.max_norm / o.norm_seen)
    meant = min(1.0, o.max_norm / (o.norm_seen / o.scale))
    changed = seen / meant < thresholds.CLIP_BITES_BELOW
    return clip_before_unscale(Observed(o.rung, Severity.ERROR if changed else Severity.WARNING,
        f"clip_grad_norm_ saw a gradient norm of {o.norm_seen:.6g}, {o.scale:g} times (the "
        f"loss scale) the true norm: it ran before scaler.unscale_. It multiplied the gradient "
        f"by {seen:.4g} where the threshold {o.max_norm:g} in true space gives {meant:.4g}"
        + (": the update is that much smaller than the script means." if changed else
           ": the same update here, but the threshold is in the wrong space."),
        evidence={"measured": significant(o.norm_seen / (o.norm_seen / o.scale)),
                  "expected": 1.0, "scale": o.scale, "clip_coefficient": significant(seen),
                  "meant_coefficient": significant(meant), "max_grad_norm": o.max_norm},
        location=o.location))


# --- the static scan: a clip between the scaled backward and the step, no unscale_ ------------


@dataclass(frozen=True)
class ClipInCode:
    """torch's `clip` (its name) at `line` (`code`) stands after `scaler`'s scaled backward (at
    `backward_line`) and before its step (`step` as written, at `step_line`), with no
    `unscale_` between."""

    line: int
    code: str
    clip: str
    scaler: str
    backward_line: int
    step: str
    step_line: int
    location: Location | None = None


def clip_in_code(o: ClipInCode) -> Finding:
    """`clip-before-unscale` read in the code: a warning (a pattern)."""
    return clip_before_unscale(Observed(SCAN_RUNG, Severity.WARNING,
        f"`{o.clip}` at line {o.line} runs after `{o.scaler}.scale(...).backward()` (line "
        f"{o.backward_line}) and before `{o.step}` (line {o.step_line}) with no "
        f"`{o.scaler}.unscale_(...)` in between: in fp16 it clips gradients still multiplied "
        "by the loss scale, so the threshold means max_norm x scale (or the update is "
        f"crushed by 1/scale). Call `{o.scaler}.unscale_(optimizer)` right before it.",
        evidence={"static": True, "backward_line": o.backward_line, "step_line": o.step_line},
        location=o.location,
        title=f"{o.clip} between scaler.scale(...).backward() and scaler.step() without "
              "unscale_"))
