"""The averaging kinds of who divides the loss by K: `missing-accumulation-average` (nothing
does) and `double-average` (two do). What the loss is divided by is `kinds/reduction.py`'s.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core import thresholds
from ..core.enums import KindId, Severity
from ..core.findings import Finding, Location
from .base import SCAN_RUNG, AccumulationLoop, Kind, Observed, in_framework_terms
from .sync import RanksCompared, words_of

MISSING_ACCUMULATION_AVERAGE = Kind(
    KindId.MISSING_ACCUMULATION_AVERAGE,
    title="The loss is not divided by the accumulation steps",
    why=(
        "K micro-batch gradients are summed, so the optimizer sees K times the full-batch "
        "gradient: "
        "the effective learning rate is K times too large (and Adam hides it, clipping masks it)."),
    fix=(
        "Divide each micro-batch loss by `accumulation_steps` before backward: "
        "`loss = criterion(out, y) / accumulation_steps`, then `scaler.scale(loss).backward()`. "
        "A hard-coded divisor must be K itself (`gradient_accumulation_steps`), not a constant."),
    example=(
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    with torch.autocast(\"cuda\", dtype=torch.float16):\n"
        "        loss = criterion(model(x), y)      # no / K\n"
        "    scaler.scale(loss).backward()\n"
        "    if (i + 1) % K == 0:\n"
        "        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()"),
    error_when=(
        "a consumed gradient is K times the reference (or a divisor smaller than K's factor): "
        "the update is that much too large. The factor is the measurement; there is no "
        "warning form."),
    measured="consumed / reference gradient norm (K)",
    decided_in=f"{__name__}:missing_accumulation_average",
    who_divides={
        "accelerate":
            "`accelerator.backward` divides by K only inside `accelerator.accumulate()` "
            "with gradient_accumulation_steps given to the Accelerator; outside it the "
            "loop must divide.",
        "HF Trainer":
            "the HF Trainer does not divide by K when the model (or compute_loss_func) "
            "accepts loss kwargs: it passes `num_items_in_batch` and expects the loss to "
            "be divided by it; a loss that ignores it sums the K micro-batches.",
        "Lightning":
            "Lightning divides by accumulate_grad_batches only in automatic optimization; "
            "with manual optimization (`manual_backward`) the loop must divide.",
        "Fabric": "`fabric.backward` does not divide by K: the loop must divide the loss.",
        "DeepSpeed":
            "`engine.backward(loss, scale_wrt_gas=False)` does not divide by the config's "
            "gradient_accumulation_steps: with it the loop must divide, once (the default "
            "`scale_wrt_gas=True` divides for it).",
    },
    matched=(
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient (cosine "
        "{cos:.5f}) = the sum of the K={K} micro-batch gradients: the loss is not divided by "
        "accumulation_steps."),
    framework_fixes={
        "accelerate":
            "Let accelerate divide: give `Accelerator(gradient_accumulation_steps=K)`, run each "
            "micro-batch under `with accelerator.accumulate(model):` and call "
            "`accelerator.backward(loss)`; a loop that accumulates outside `accumulate()` divides "
            "itself: `accelerator.backward(loss / K)`.",
        "HF Trainer":
            "The Trainer passes `num_items_in_batch` (the tokens or samples of the whole step over "
            "all K micro-batches) when the model or `compute_loss_func` accepts loss kwargs, and "
            "then does not divide: sum the loss (`reduction='sum'`) and return `loss_sum / "
            "num_items_in_batch` from `compute_loss`, or drop `**kwargs` from the model's forward "
            "so the Trainer divides the mean loss by K.",
        "Lightning":
            "In manual optimization divide in `training_step`: `self.manual_backward(loss / N)` "
            "with N the batches per optimizer step (or use automatic optimization with "
            "`Trainer(accumulate_grad_batches=N)`, which divides for you).",
        "Fabric":
            "Divide before `fabric.backward`: `fabric.backward(loss / K)` (`fabric.backward` does "
            "not divide by K).",
        "DeepSpeed":
            "Let the engine divide: call `engine.backward(loss)` with its default "
            "`scale_wrt_gas=True`; with `scale_wrt_gas=False` the loop must divide by K itself.",
    },
)


DOUBLE_AVERAGE = Kind(
    KindId.DOUBLE_AVERAGE,
    title="The gradient is averaged twice",
    why=(
        "The loss is divided by K and the gradient (or the loss again) is divided by K once more, "
        "so the update is K times too small. Under DDP: the loss divided by the world size on "
        "top of DDP's own averaging over ranks. A hard-coded divisor larger than K (`/ 8` for "
        "K=4) is reported the same way."),
    fix=(
        "Average exactly once: keep `loss = criterion(out, y) / accumulation_steps` and delete "
        "the second division (`p.grad /= K`, `loss / K` a second time, `/ dist.get_world_size()` "
        "under DDP, which already averages over ranks)."),
    example=(
        "loss = criterion(model(x), y) / K\n"
        "scaler.scale(loss).backward()\n"
        "if (i + 1) % K == 0:\n"
        "    scaler.unscale_(optimizer)\n"
        "    for p in model.parameters():\n"
        "        p.grad /= K                       # averaged a second time\n"
        "    scaler.step(optimizer); scaler.update(); optimizer.zero_grad()"),
    error_when=(
        "a consumed gradient is 1/K of the reference (1/world_size under DDP, K/divisor for a "
        "hard-coded divisor): the update is that much too small."),
    measured="consumed / reference gradient norm (1/K; under DDP 1/world_size)",
    decided_in=f"{__name__}:double_average",
    who_divides={
        "accelerate":
            "`accelerator.backward` already divides the loss by gradient_accumulation_steps "
            "inside `accelerator.accumulate()`, so the loop's own division is the second "
            "one: remove it.",
        "HF Trainer":
            "the HF Trainer already divides the loss by gradient_accumulation_steps (when "
            "the model takes no loss kwargs), so a division in compute_loss is the "
            "second one: remove it.",
        "Lightning":
            "Lightning's automatic optimization already divides the loss by "
            "accumulate_grad_batches, so a division in training_step is the second one "
            "(manual optimization divides nowhere: there the loop must, once).",
        "Fabric": "`fabric.backward` does not divide: the loss is divided twice in the loop.",
        "DeepSpeed":
            "`engine.backward(loss)` already divides the loss by the config's "
            "gradient_accumulation_steps (its `scale_wrt_gas=True` default), so the loop's "
            "own division is the second one: remove it (or pass `scale_wrt_gas=False` and "
            "keep exactly one).",
    },
    matched=(
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient (cosine "
        "{cos:.5f}), 1/K with K={K}: the gradient is averaged twice."),
    framework_fixes={
        "accelerate":
            "Remove your own division: inside `with accelerator.accumulate(model):` with "
            "`Accelerator(gradient_accumulation_steps=K)`, `accelerator.backward(loss)` already "
            "divides by K, so backward the micro-batch's mean loss as it is "
            "(`accelerator.backward(loss)`, not `loss / K`) and never divide `.grad` yourself.",
        "HF Trainer":
            "Remove the division from `compute_loss` (or from the model's loss): the Trainer "
            "divides by gradient_accumulation_steps itself when the model takes no loss kwargs, so "
            "return the micro-batch's mean loss as it is.",
        "Lightning":
            "Return the plain loss from `training_step`: with automatic optimization Lightning "
            "divides by `accumulate_grad_batches` itself, so delete your `/ "
            "accumulate_grad_batches`.",
        "Fabric":
            "Divide once: `fabric.backward(loss / K)` and nothing more (`fabric.backward` does not "
            "divide, so both divisions are yours: delete the second).",
        "DeepSpeed":
            "Remove your own division: `engine.backward(loss)` divides by the config's "
            "gradient_accumulation_steps itself (`scale_wrt_gas=True`), so backward the "
            "micro-batch's mean loss as it is (or pass `scale_wrt_gas=False` and divide once).",
    },
)


def missing_accumulation_average(seen: Observed) -> Finding:
    """`missing-accumulation-average`: the loss is not divided by the accumulation steps.
    Error: a consumed gradient K x the reference (no warning form).
    (`MISSING_ACCUMULATION_AVERAGE.error_when`)"""
    seen = in_framework_terms(MISSING_ACCUMULATION_AVERAGE, seen)
    return Finding(seen.rung, KindId.MISSING_ACCUMULATION_AVERAGE, seen.severity,
                   **seen.fields(MISSING_ACCUMULATION_AVERAGE))


def double_average(seen: Observed) -> Finding:
    """`double-average`: the gradient is averaged twice.
    Error: a consumed gradient 1/K (1/world_size, K/divisor) of the reference.
    (`DOUBLE_AVERAGE.error_when`)"""
    seen = in_framework_terms(DOUBLE_AVERAGE, seen)
    return Finding(seen.rung, KindId.DOUBLE_AVERAGE, seen.severity, **seen.fields(DOUBLE_AVERAGE))


# --- a loop that sums K micro-batch means (the words of rules/unaveraged's measurement) ------


@dataclass(frozen=True)
class Unaveraged:
    """The loop's window gradient (before the clip) against the combination it sums: `factor`
    times their mean (K when nothing divides by K), which gradients (`basis`), how that mean
    compares with the reference, and the loop alone on each micro-batch against its
    reference."""

    factor: float
    basis: str
    weighting_differs: bool
    mean_ratio: float
    mean_cosine: float
    per_microbatch_ratio: tuple[float, ...] = ()
    per_microbatch_cosine: tuple[float, ...] = ()


#: The fix when the weighting differs too: dividing by K alone leaves the weighting wrong.
UNAVERAGED_FIX = (
    "Normalise the whole optimizer step once, the way the reference does: for a token- or "
    "sample-weighted loss, sum each micro-batch's per-token (per-sample) losses and divide "
    "by the count over all K micro-batches of the step (no further / K); for a loss that "
    "weighs micro-batches equally, compute it as the reference's `loss` does and divide it "
    "by accumulation_steps.")


def unaveraged_message(step: int, K: int, u: Unaveraged, clip_norm: float | None,
                       max_norm: float | None, after_clip: float | None) -> str:
    """Both mistakes, each with its number, and what the clip did to the update."""
    text = (f"Step {step}: before the clip, the gradient is {u.factor:.4g}x the mean of "
            f"{u.basis}, i.e. their sum: the loss is not divided by accumulation_steps "
            f"(K={K}).")
    if not u.weighting_differs:
        return text + (f" That mean is the reference (norm ratio {u.mean_ratio:.4g}, cosine "
                       f"{u.mean_cosine:.5f}): dividing by K makes it match.")
    text += (f" The weighting differs as well: that mean is {u.mean_ratio:.4g}x the reference "
             f"with cosine {u.mean_cosine:.5f}, so micro-batches (or the tokens in them) do not "
             "weigh what they weigh in the reference")
    ratios = u.per_microbatch_ratio
    if ratios and any(abs(r - 1) > thresholds.RATIO_NEAR_ONE
                      or c < thresholds.SAME_DIRECTION_COSINE
                      for r, c in zip(ratios, u.per_microbatch_cosine, strict=False)):
        text += (" -- already within one micro-batch (the loop alone on each is "
                 + ", ".join(f"{r:.3g}x" for r in ratios) + " its reference, cosine "
                 + ", ".join(f"{c:.4f}" for c in u.per_microbatch_cosine) + ")")
    text += "."
    if clip_norm is not None and max_norm is not None and after_clip is not None \
            and math.isfinite(clip_norm) and clip_norm > max_norm:
        text += (f" The clip bit (total norm {clip_norm:.4g} > {max_norm:g}), so the update is "
                 f"{after_clip:.4g}x the reference, not {K}x: dividing by K alone will not make "
                 "it match.")
    else:
        text += " Dividing by K alone will not make it match."
    return text


@dataclass(frozen=True)
class DividedByWorldSize:
    """Every rank consumed `ratio` x the reference gradient of the global batch, within
    tolerance of 1/world_size: the wrapper averages over the ranks and the loss does too."""

    rung: str
    who: str                    # the wrapper (`kinds.sync.WORDS`' "who")
    ratio: float                # before a clip that bit (`RanksCompared.ratio_before_clip`)
    ranks: RanksCompared
    location: Location | None = None


def divided_by_world_size(o: DividedByWorldSize) -> Finding:
    """`double-average` over the ranks: an error (the update is 1/world_size short)."""
    return double_average(Observed(o.rung, Severity.ERROR,
        f"Every rank consumed {o.ratio:.4g}x the reference gradient of the global batch: "
        f"1/world_size (={1 / o.ranks.world_size:g}). {words_of(o.who)['who']} already "
        "averages gradients over the ranks; the loss is divided by the world size on top of "
        "that.",
        evidence={"measured": round(o.ratio, 6), "expected": 1.0, **o.ranks.evidence()},
        location=o.location))


# --- the static scan: a loss that reaches backward divided by nothing ------------------------


@dataclass(frozen=True)
class UndividedLoss:
    """`loss` (as written) reaches the backward `code` at `line` of `loop` divided (or
    multiplied) by nothing on the way."""

    line: int
    code: str
    loss: str
    loop: AccumulationLoop
    location: Location | None = None


def undivided_loss(o: UndividedLoss) -> Finding:
    """`missing-accumulation-average` read in the code: a warning (a pattern; what builds the
    loss may divide where the scan cannot see)."""
    k = o.loop.k_text
    return missing_accumulation_average(Observed(SCAN_RUNG, Severity.WARNING,
        f"`{o.loss}` reaches `backward()` at line {o.line} {o.loop.context()}, and it is divided "
        f"by nothing on the way: each optimizer step gets the sum of {k} micro-batch gradients, "
        f"{k} times the mean. Divide it by {k} before backward (or confirm that what builds it "
        "already does).", evidence=o.loop.evidence(), location=o.location,
        title="The loss reaches backward() without a division by the accumulation steps"))
