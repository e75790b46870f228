"""The averaging kinds of what the loss is divided by: `reduction-mismatch` (a sum over the
micro-batch's samples or tokens divided by K alone, or by a count that varies per step) and
`weighted-average-mismatch` (K token-weighted means averaged with equal weight). Who divides by
K is `kinds/accumulation.py`'s.

Each kind here is one unit: its catalogue text, the measured consequence that makes it an error
(`error_when`), what its `evidence.measured` counts, its fix in a framework's terms, its one
decider (`decided_in`) and the typed observations of the rules that measure it
(`SummedOverCount`, `VaryingDivisor`), worded here.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.enums import KindId, Severity
from ..core.evidence import Evidence, significant
from ..core.findings import Finding, Location
from .base import Kind, Observed, in_framework_terms

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
