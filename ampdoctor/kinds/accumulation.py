"""The averaging kinds: who divides the loss by K, and by what: `missing-accumulation-average`,
`double-average`, `reduction-mismatch`, `weighted-average-mismatch`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from ..enums import KindId
from ..findings import Finding
from .base import Kind, Observed, in_framework_terms

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
