"""The kind of an update off the reference in no known shape: `gradient-mismatch`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import thresholds
from ..enums import KindId, Severity
from ..evidence import Evidence, significant
from ..findings import Finding, Location
from .base import Kind, Observed

GRADIENT_MISMATCH = Kind(
    KindId.GRADIENT_MISMATCH,
    title="The update differs from the reference in no known shape",
    why=(
        "The gradient the optimizer consumed differs from the fp32 full-batch reference beyond the "
        "tolerance, and the difference matches none of the known shapes (a factor K, 1/K, b, "
        "S...). "
        "Also reported for an off-by-one window condition, a loop that stops early, and DDP ranks "
        "that consume different gradients."),
    fix=(
        "Compare the loop with the correct skeleton: `loss / K` -> `scaler.scale(loss).backward()` "
        "x K -> `scaler.unscale_` -> clip -> `scaler.step` -> `scaler.update` -> `zero_grad`, "
        "stepping when `(i + 1) % K == 0`; the finding names the first bad step and its numbers."),
    example=(
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    if i % K == 0:                # off by one: steps after micro-batch 0\n"
        "        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()"),
    error_when=(
        "a consumed update differs from the reference beyond tolerance in no known shape "
        "(always with the numbers and the first bad step)."),
    measured="consumed / reference gradient norm, first bad step",
    decided_in=f"{__name__}:gradient_mismatch",
)


def gradient_mismatch(seen: Observed) -> Finding:
    """`gradient-mismatch`: the update differs from the reference in no known shape.
    Error: an update off the reference in no known shape. (`GRADIENT_MISMATCH.error_when`)"""
    return Finding(seen.rung, KindId.GRADIENT_MISMATCH, seen.severity,
                   **seen.fields(GRADIENT_MISMATCH))


@dataclass(frozen=True)
class OffBoundary:
    """An optimizer whose first step came after a count of micro-batches that is no multiple
    of K (an off-by-one accumulation condition): the micro-batches consumed at each step."""

    rung: str
    optimizer: int
    K: int
    consumed: tuple[int, ...]
    location: Location | None = None


OFF_BY_ONE_TITLE = "The optimizer steps off the window boundaries (off by one)"


def off_boundary(o: OffBoundary) -> Finding:
    """`gradient-mismatch` of an off-by-one window: every window after the first straddles
    two (an error)."""
    first = o.consumed[0]
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"The optimizer stepped after {first} micro-batch(es), not on a boundary of "
        f"K={o.K}: the accumulation condition is off by one (e.g. "
        "`i % K == 0` with i counted from 0), so the first window holds "
        f"{first} micro-batch(es) and every later window straddles two.",
        evidence={"measured": first, "expected": o.K,
                  "microbatches_at_each_step": list(o.consumed), "optimizer": o.optimizer},
        location=o.location, title=OFF_BY_ONE_TITLE,
        fix="Step when the count of micro-batches seen is a multiple of K: "
            "`if (i + 1) % K == 0:` with i counted from 0 (or count from 1)."))


@dataclass(frozen=True)
class TooFewSteps:
    """The fp32 loop stepped fewer times than there are windows (`steps`, 0: never, with the
    backwards it ran; `lightning_none`: it stepped but no backward ran before any step)."""

    rung: str
    steps: int
    windows: int
    K: int
    taken: int                  # micro-batches the loop took
    microbatches: int           # micro-batches it was handed
    backwards: int = 0
    called_step: int = 0        # optimizer.step() calls (with no backward before any)
    location: Location | None = None


def too_few_steps(o: TooFewSteps) -> Finding:
    """`gradient-mismatch` of windows that never reach the model: an error."""
    if o.steps == 0:
        how = ("it never called optimizer.step()" if not o.called_step else
               f"it called optimizer.step() {o.called_step} time(s), but no backward ran "
               "before any of them (a Lightning `training_step` that returns None skips the "
               "backward and the step: return the loss)")
        return gradient_mismatch(Observed(o.rung, Severity.ERROR,
            f"No optimizer step was taken in {o.taken} micro-batches: the fp32 loop took "
            f"{o.taken} of {o.microbatches} micro-batches and ran {o.backwards} backward "
            f"pass(es); {how}.",
            evidence={"measured": 0, "expected": o.windows, "microbatches_taken": o.taken,
                      "backwards": o.backwards, "optimizer_steps": o.called_step},
            location=o.location))
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"The fp32 loop took {o.steps} optimizer step(s) for the {o.windows} windows of "
        f"K={o.K} micro-batches in the spec (it took {o.taken} of {o.microbatches} "
        "micro-batches): it stops early or never steps for the last windows, so those "
        "windows' data never reaches the model.",
        evidence={"measured": o.steps, "expected": o.windows, "microbatches_taken": o.taken,
                  "microbatches": o.microbatches},
        location=o.location))


@dataclass(frozen=True)
class Unexplained:
    """The judge's first bad step in no known shape: its ordinal and window, the precision,
    the numbers of the comparison (relative error, norm ratio, cosine, tolerance) and the
    comparison keys. `shape_tried`: the rules looked for a known shape (else the step's
    weights were gone and only the numbers are said)."""

    rung: str
    step: int
    window: int
    precision: str
    rel_err: float
    ratio: float
    cosine: float
    tolerance: float
    comparison: Evidence
    shape_tried: bool = True
    forced_clip: float | None = None
    location: Location | None = None


def unexplained(o: Unexplained) -> Finding:
    """`gradient-mismatch`: an update off the reference in no known shape (an error)."""
    if not o.shape_tried:
        return gradient_mismatch(Observed(o.rung, Severity.ERROR,
            f"Step {o.step}: the optimizer consumed a gradient {o.rel_err:.3g} "
            f"(relative) from the {o.precision} reference (norm ratio "
            f"{o.ratio:.4g}, cosine {o.cosine:.4f}).",
            evidence=o.comparison, location=o.location, forced_clip=o.forced_clip))
    hint = ""
    if o.cosine > thresholds.SAME_DIRECTION_COSINE:   # only the size is off
        hint = f" The direction is right (cosine {o.cosine:.5f}); only the size differs."
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"Step {o.step} (window {o.window}) of the "
        f"{o.precision} run: the gradient the optimizer consumed differs "
        f"from the fp32 reference by {o.rel_err:.3g} (relative; tolerance "
        f"{o.tolerance:g}), norm ratio {o.ratio:.4g}, cosine "
        f"{o.cosine:.4f}, matching no known mistake.{hint}",
        evidence=o.comparison, location=o.location, forced_clip=o.forced_clip))


CLIP_AFTER_STEP_FIX = (
    "Clip before the step that consumes the gradients: `scaler.unscale_(optimizer)`, then "
    "`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, then "
    "`scaler.step(optimizer)` and `scaler.update()` (without a scaler: clip, then "
    "`optimizer.step()`).")


@dataclass(frozen=True)
class ClipAfterStep:
    """A clip that bit after the optimizer step that consumed the gradients: the norm it saw,
    its threshold, the judged update/reference norm ratio of that step (None when unknown)."""

    rung: str
    step: int
    total_norm: float
    max_norm: float
    tolerance: float
    ratio: float | None = None
    forced_clip: float | None = None
    location: Location | None = None


def clip_after_step(o: ClipAfterStep) -> Finding:
    """`gradient-mismatch` of a clip after its step: the update used an unclipped gradient (an
    error)."""
    factor = o.total_norm / o.max_norm
    evidence: Evidence = {"measured": significant(factor), "expected": 1.0, "step": o.step,
                          "clip_total_norm": significant(o.total_norm),
                          "max_grad_norm": significant(o.max_norm), "tolerance": o.tolerance}
    if o.ratio is not None:   # the update against the unclipped reference: it matched
        evidence["ratio"] = significant(o.ratio)
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"Step {o.step}: the gradient clip ran after the optimizer step, on gradients the "
        f"step had already consumed: their norm was {o.total_norm:.4g} against "
        f"max_norm={o.max_norm:.4g}, so the update used a gradient {factor:.4g}x the "
        "clipped one the loop means, and the clip only rescaled gradients about to be "
        "cleared.",
        evidence=evidence, location=o.location, fix=CLIP_AFTER_STEP_FIX,
        forced_clip=o.forced_clip))
