"""The averaging kinds: who divides the loss by K, and by what: `missing-accumulation-average`,
`double-average`, `reduction-mismatch`, `weighted-average-mismatch`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import thresholds
from ..enums import KindId, Severity
from ..evidence import Evidence, significant
from ..findings import Finding, Location
from .base import Kind, Observed, in_framework_terms
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


REDUCTION_MISMATCH = Kind(
    KindId.REDUCTION_MISMATCH,
    title="The loss reduction does not match the averaging factor",
    why=(
        "The loss sums over samples or tokens (`reduction='sum'`, `.sum()`) while the loop "
        "divides only by K, so the gradient is scaled by the number of samples (or tokens) per "
        "micro-batch; when that count changes from step to step, so does the effective learning "
        "rate."),
    fix=(
        "Use `reduction='mean'` and divide by K: `loss = F.cross_entropy(logits, y) / K`. Or keep "
        "the sum and divide by the sample/token count of the whole optimizer step, counted once "
        "over all K micro-batches before the window: `loss = loss_sum / step_count`."),
    example=(
        "criterion = nn.CrossEntropyLoss(reduction=\"sum\")\n"
        "...\n"
        "loss = criterion(model(x), y) / K          # a sum over b samples, / K only\n"
        "scaler.scale(loss).backward()"),
    error_when=(
        "a consumed gradient is a count of the micro-batch (samples, tokens) times the "
        "reference, or its factor changes from step to step."),
    measured="consumed / reference gradient norm (b, a token count)",
    decided_in=f"{__name__}:reduction_mismatch",
    matched=(
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient (cosine "
        "{cos:.5f}): {label}. The loss reduction and the averaging factor disagree."),
    framework_fixes={
        "HF Trainer":
            "Return a mean from `compute_loss`, or a sum divided by `num_items_in_batch` (the "
            "count of the whole step, which the Trainer passes): never a sum over the micro-batch "
            "alone.",
        "accelerate":
            "Average inside each micro-batch (`reduction='mean'`) and call "
            "`accelerator.backward(loss)`, which divides by K; or keep the sum and backward "
            "`loss_sum / step_count * K`, step_count the samples or tokens of the whole step "
            "(accelerate divides by K again).",
        "Lightning":
            "Return a mean from `training_step` (`reduction='mean'`): automatic optimization "
            "divides it by `accumulate_grad_batches`; in manual optimization divide by N yourself.",
        "Fabric":
            "Use `reduction='mean'` and `fabric.backward(loss / K)`, or keep the sum and "
            "`fabric.backward(loss_sum / step_count)` with step_count counted over the whole step.",
    },
)


WEIGHTED_AVERAGE_MISMATCH = Kind(
    KindId.WEIGHTED_AVERAGE_MISMATCH,
    title="Micro-batches are weighted equally although the loss is token/sample weighted",
    why=(
        "Each micro-batch loss is a weighted mean over its own tokens, then the K means are "
        "averaged "
        "with equal weight. When micro-batches hold different numbers of tokens this is not the "
        "weighted mean over the whole step: short micro-batches count too much."),
    fix=(
        "Count the step's tokens once before the window (`n = sum((mb['labels'] != -100).sum() "
        "for mb in window)`) and backward `loss_sum / n` for each micro-batch, with `loss_sum = "
        "F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, "
        "reduction='sum')`. In the spec, let `loss` return `(loss_sum, weight_sum)`."),
    example=(
        "for i, batch in enumerate(micro_batches):\n"
        "    out = model(batch[\"input_ids\"], labels=batch[\"labels\"])\n"
        "    loss = out.loss / K    # mean over its own tokens; each micro-batch 1/K\n"
        "    scaler.scale(loss).backward()"),
    error_when=(
        "a consumed gradient differs from the token/sample-weighted reference beyond tolerance "
        "and equals the equal-weight mean of the micro-batches."),
    measured="consumed / reference gradient norm",
    decided_in=f"{__name__}:weighted_average_mismatch",
    matched=(
        "Step {step}: the optimizer consumed the {label} (norm ratio {ratio:.4g}, cosine "
        "{cos:.5f} to the weighted reference): micro-batches with few tokens count as much as "
        "full ones."),
    framework_fixes={
        "HF Trainer":
            "Let the loss take `num_items_in_batch`: sum each micro-batch's token losses and "
            "divide by `num_items_in_batch` (the step's token count, which the Trainer passes when "
            "`compute_loss` or the model accepts it) instead of averaging each micro-batch alone.",
        "accelerate":
            "Count the step's tokens once before the window (gather them across ranks with "
            "`accelerator.gather`), sum each micro-batch's token losses and backward "
            "`loss_sum / step_tokens * K` (`accelerator.backward` divides by K again).",
        "Lightning":
            "Automatic optimization divides every batch's loss by N alike: weigh by tokens in "
            "manual optimization, counting the step's tokens over its N batches first and calling "
            "`self.manual_backward(loss_sum / step_tokens)` for each batch.",
        "Fabric":
            "Count the step's tokens once before the window and call "
            "`fabric.backward(loss_sum / step_tokens)` for each micro-batch (`fabric.backward` "
            "does not divide).",
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


def reduction_mismatch(seen: Observed) -> Finding:
    """`reduction-mismatch`: the loss reduction does not match the averaging factor.
    Error: a consumed gradient a count times the reference, or a varying factor.
    (`REDUCTION_MISMATCH.error_when`)"""
    seen = in_framework_terms(REDUCTION_MISMATCH, seen)
    return Finding(seen.rung, KindId.REDUCTION_MISMATCH, seen.severity,
                   **seen.fields(REDUCTION_MISMATCH))


def weighted_average_mismatch(seen: Observed) -> Finding:
    """`weighted-average-mismatch`: micro-batches are weighted equally although the loss is
    token/sample weighted.
    Error: off the weighted reference, on the equal-weight mean.
    (`WEIGHTED_AVERAGE_MISMATCH.error_when`)"""
    seen = in_framework_terms(WEIGHTED_AVERAGE_MISMATCH, seen)
    return Finding(seen.rung, KindId.WEIGHTED_AVERAGE_MISMATCH, seen.severity,
                   **seen.fields(WEIGHTED_AVERAGE_MISMATCH))


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


# --- a sum reduction, read from the size of the consumed gradient ----------------------------


@dataclass(frozen=True)
class SummedOverCount:
    """Right direction, a size equal to a count every micro-batch shares (`count`, described
    as the rule read it: "the 8 tokens per micro-batch", "micro_batch_size 8")."""

    rung: str
    step: int
    ratio: float
    cosine: float
    count: int
    count_what: str
    comparison: Evidence
    forced_clip: float | None = None
    location: Location | None = None


def summed_over_count(o: SummedOverCount) -> Finding:
    """`reduction-mismatch`: the gradient is a count times the reference (an error)."""
    evidence: Evidence = {**o.comparison, "factor": significant(o.ratio), "count": o.count}
    return reduction_mismatch(Observed(o.rung, Severity.ERROR,
        f"Step {o.step}: the gradient is {o.ratio:.4g}x the reference ({o.count_what}) with "
        f"cosine {o.cosine:.5f}: the loss sums over samples/elements instead of averaging.",
        evidence=evidence, location=o.location, forced_clip=o.forced_clip))


@dataclass(frozen=True)
class VaryingDivisor:
    """Right direction at every step, a factor that changes from step to step (`ratios`, each
    step's before its clip)."""

    rung: str
    step: int
    ratio: float
    ratios: tuple[float, ...]
    comparison: Evidence
    forced_clip: float | None = None
    location: Location | None = None


VARYING_DIVISOR_FIX = ("Count the tokens (or samples) of the whole optimizer step once, over all "
                       "K micro-batches before the window, and divide every micro-batch's "
                       "summed loss by that one total.")


def varying_divisor(o: VaryingDivisor) -> Finding:
    """`reduction-mismatch` of a divisor that varies per step: an error ("divide by K" would not
    fix it)."""
    low, high = min(o.ratios), max(o.ratios)
    evidence: Evidence = {**o.comparison, "ratios_per_step": [significant(r) for r in o.ratios],
                          "ratio_spread": significant(high / low - 1)}
    return reduction_mismatch(Observed(o.rung, Severity.ERROR,
        f"Step {o.step}: the optimizer consumed {o.ratio:.4g}x the reference gradient with "
        "the right direction, and the factor changes from step to step ("
        + ", ".join(f"{r:.4g}" for r in o.ratios) + "): the loss is normalised by a count "
        "that varies per step (e.g. the token count of one micro-batch, overwritten in a "
        "loop) instead of the whole step's total. Divide the summed loss by the number of "
        "tokens/samples in the whole optimizer step.",
        evidence=evidence, location=o.location, fix=VARYING_DIVISOR_FIX,
        forced_clip=o.forced_clip))


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
