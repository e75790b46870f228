"""What a kind's decider says beyond the catalogue (`kinds.py`): the measured consequence that
makes each kind an error (`ERROR_WHEN`, which docs/kinds.md states under each kind's
**Error when**, checked by tests/test_deciders.py), and the fix of a kind in the terms of the
framework that drove the run (`FRAMEWORK_FIXES`, `SKIP_AWARE_FIX`).

This module must not import torch: `report` and `explain` run without it.
"""

from __future__ import annotations

from .enums import KindId

#: kind -> the measured consequence that makes a finding of it an `error` (and what stays a
#: warning). The rule of every kind: only a measured consequence is an error -- the consumed
#: update, or the LR / loss-scale trajectory, or the communication volume where a rung judges
#: those, differs from the reference; a call pattern whose update matched is at most a warning.
ERROR_WHEN: dict[str, str] = {
    KindId.NONDETERMINISTIC_BASELINE:
        "two fp32 runs of the reference from the same weights and data differ beyond the "
        "repeat tolerance: no later comparison could mean anything.",
    KindId.MISSING_ACCUMULATION_AVERAGE:
        "a consumed gradient is K times the reference (or a divisor smaller than K's factor): "
        "the update is that much too large. The factor is the measurement; there is no "
        "warning form.",
    KindId.DOUBLE_AVERAGE:
        "a consumed gradient is 1/K of the reference (1/world_size under DDP, K/divisor for a "
        "hard-coded divisor): the update is that much too small.",
    KindId.REDUCTION_MISMATCH:
        "a consumed gradient is a count of the micro-batch (samples, tokens) times the "
        "reference, or its factor changes from step to step.",
    KindId.WEIGHTED_AVERAGE_MISMATCH:
        "a consumed gradient differs from the token/sample-weighted reference beyond tolerance "
        "and equals the equal-weight mean of the micro-batches.",
    KindId.STEP_PER_MICROBATCH:
        "the optimizer stepped more often than there are windows: each update applied part of "
        "a window, and the parameters follow another trajectory than the reference's.",
    KindId.ZERO_GRAD_INSIDE_ACCUMULATION:
        "a step's update differs from the reference and only the micro-batches after a "
        "zero_grad inside the window reached it.",
    KindId.MISSING_NO_SYNC:
        "the window's one sync ran on another backward than its last (the ranks consumed "
        "different gradients), or DDP synced on every micro-batch (K times the measured "
        "communication for the same update). Warning: FSDP2's reduce-scatter on every "
        "micro-batch while the update is right (a documented trade of communication for "
        "memory).",
    KindId.HALF_OPEN_AMP:
        "the precision that ran is not the one the run asks for -- autocast never entered, "
        "entered with another dtype, or fp16 without an enabled GradScaler -- so the rung "
        "would judge a precision the training does not use; in the fp32 run, autocast entered "
        "and an update differs. Warning: a GradScaler enabled in bf16, or autocast in the fp32 "
        "run whose updates still match.",
    KindId.CLIP_BEFORE_UNSCALE:
        "a clip in scaled space shrank the update by another factor than the same threshold "
        "in true space: the update differs. Warning: the clip has not bitten yet (the update "
        "matched), or it clips at the threshold times the scale (the same update).",
    KindId.MISSING_UNSCALE:
        "an optimizer consumed gradients still multiplied by the loss scale (the update is S "
        "times the reference) or consumed the injected inf. Warning: the update matched only "
        "because the scale was 1.",
    KindId.UNSCALE_TWICE:
        "an update is 1/S of the reference, or torch refused the second unscale_ of a step.",
    KindId.UPDATE_PER_MICROBATCH:
        "the loss-scale trajectory differs: one overflowing micro-batch backed the scale off "
        "more than once, or torch refused an update() with no inf check before it.",
    KindId.DOUBLE_SCALING:
        "the loss reaching backward carries a second scale factor (measured in the fp16 run), "
        "or two loss-scale owners stand on one training path; for two GradScalers of the "
        "diagnosed loop, only when the run saw them on one loss or one optimizer's gradients "
        "(one scaled what the other unscales or steps, both step one optimizer, or one scaled "
        "an already scaled loss); each on its own losses and optimizer is no finding. "
        "Warning: owners in separate entry points that no scanned file runs together, or two "
        "GradScalers of the loop that no run could tell apart.",
    KindId.SCHEDULER_PER_MICROBATCH:
        "an optimizer step used another learning rate than the schedule's value for that step "
        "(the scheduler stepped more than once between two steps). A constant schedule stepped "
        "per micro-batch changes nothing and is not reported.",
    KindId.SCHEDULER_STEPS_ON_SKIP:
        "the scheduler advanced on skips of the run's own that persist after the scale settled "
        "(at least `MIN_COUNTED_SKIPS` at a steady rate above `SCHEDULER_SKIP_RATE`: the "
        "schedule runs 1/(1 - rate) times too fast), or a skip after the calibration moved a "
        "real update's learning rate beyond the rung's tolerance. Warning, with their count: "
        "the calibration skips before the first real update (a constant shift of a few steps "
        "at the start of training), a rare later skip whose shift stays within tolerance, and "
        "any of it in a run forced into fp16. Not reported: a scheduler that advanced on the "
        "injected skip alone (the rung's summary says so).",
    KindId.NO_ZERO_GRAD_AFTER_SKIP:
        "after the injected overflow the next window(s) were skipped too (updates dropped), or "
        "the loop's own skip path left the inf in .grad and torch refused the next unscale_. "
        "Warning: in a run forced into fp16.",
    KindId.MISSING_ZERO_GRAD:
        "a step consumed its window's gradient plus an earlier window's: the update differs.",
    KindId.FREQUENT_SKIPS:
        "after the first real update more than `SKIP_RATE_THRESHOLD` of the steps were skipped "
        "(at least `MIN_COUNTED_SKIPS`, or one right after growing at a short growth_interval): "
        "updates the reference makes are dropped; or a GradScaler rebuilt during training "
        "restarted the scale (the next step started from another scale than the last update "
        "left): a backoff that does not last. Warning: the scale settling, a scale below "
        "`MIN_SCALE`, a run that never settles, and any of it in a run forced into fp16.",
    KindId.GRADIENT_MISMATCH:
        "a consumed update differs from the reference beyond tolerance in no known shape "
        "(always with the numbers and the first bad step).",
    KindId.LOOP_ERROR:
        "the loop raised or hung: nothing after it can be judged (exit 3).",
}

#: The fix of an accumulation kind in the terms of the framework that drove the run
#: (`evidence.framework`): who divides by K there and what to change. A kind or framework not
#: here takes the catalogue's fix (the hand-written loop's terms).
FRAMEWORK_FIXES: dict[tuple[str, str], str] = {
    ("double-average", "accelerate"):
        "Remove your own division: inside `with accelerator.accumulate(model):` with "
        "`Accelerator(gradient_accumulation_steps=K)`, `accelerator.backward(loss)` already "
        "divides by K, so backward the micro-batch's mean loss as it is "
        "(`accelerator.backward(loss)`, not `loss / K`) and never divide `.grad` yourself.",
    ("double-average", "HF Trainer"):
        "Remove the division from `compute_loss` (or from the model's loss): the Trainer "
        "divides by gradient_accumulation_steps itself when the model takes no loss kwargs, so "
        "return the micro-batch's mean loss as it is.",
    ("double-average", "Lightning"):
        "Return the plain loss from `training_step`: with automatic optimization Lightning "
        "divides by `accumulate_grad_batches` itself, so delete your `/ accumulate_grad_batches`.",
    ("double-average", "Fabric"):
        "Divide once: `fabric.backward(loss / K)` and nothing more (`fabric.backward` does not "
        "divide, so both divisions are yours: delete the second).",
    ("missing-accumulation-average", "accelerate"):
        "Let accelerate divide: give `Accelerator(gradient_accumulation_steps=K)`, run each "
        "micro-batch under `with accelerator.accumulate(model):` and call "
        "`accelerator.backward(loss)`; a loop that accumulates outside `accumulate()` divides "
        "itself: `accelerator.backward(loss / K)`.",
    ("missing-accumulation-average", "HF Trainer"):
        "The Trainer passes `num_items_in_batch` (the tokens or samples of the whole step over "
        "all K micro-batches) when the model or `compute_loss_func` accepts loss kwargs, and "
        "then does not divide: sum the loss (`reduction='sum'`) and return `loss_sum / "
        "num_items_in_batch` from `compute_loss`, or drop `**kwargs` from the model's forward "
        "so the Trainer divides the mean loss by K.",
    ("missing-accumulation-average", "Lightning"):
        "In manual optimization divide in `training_step`: `self.manual_backward(loss / N)` "
        "with N the batches per optimizer step (or use automatic optimization with "
        "`Trainer(accumulate_grad_batches=N)`, which divides for you).",
    ("missing-accumulation-average", "Fabric"):
        "Divide before `fabric.backward`: `fabric.backward(loss / K)` (`fabric.backward` does "
        "not divide by K).",
    ("reduction-mismatch", "HF Trainer"):
        "Return a mean from `compute_loss`, or a sum divided by `num_items_in_batch` (the "
        "count of the whole step, which the Trainer passes): never a sum over the micro-batch "
        "alone.",
    ("weighted-average-mismatch", "HF Trainer"):
        "Let the loss take `num_items_in_batch`: sum each micro-batch's token losses and divide "
        "by `num_items_in_batch` (the step's token count, which the Trainer passes when "
        "`compute_loss` or the model accepts it) instead of averaging each micro-batch alone.",
    ("weighted-average-mismatch", "accelerate"):
        "Count the step's tokens once before the window (gather them across ranks with "
        "`accelerator.gather`), sum each micro-batch's token losses and backward "
        "`loss_sum / step_tokens * K` (`accelerator.backward` divides by K again).",
    ("reduction-mismatch", "accelerate"):
        "Average inside each micro-batch (`reduction='mean'`) and call "
        "`accelerator.backward(loss)`, which divides by K; or keep the sum and backward "
        "`loss_sum / step_count * K`, step_count the samples or tokens of the whole step "
        "(accelerate divides by K again).",
    ("reduction-mismatch", "Lightning"):
        "Return a mean from `training_step` (`reduction='mean'`): automatic optimization divides "
        "it by `accumulate_grad_batches`; in manual optimization divide by N yourself.",
    ("reduction-mismatch", "Fabric"):
        "Use `reduction='mean'` and `fabric.backward(loss / K)`, or keep the sum and "
        "`fabric.backward(loss_sum / step_count)` with step_count counted over the whole step.",
    ("weighted-average-mismatch", "Lightning"):
        "Automatic optimization divides every batch's loss by N alike: weigh by tokens in "
        "manual optimization, counting the step's tokens over its N batches first and calling "
        "`self.manual_backward(loss_sum / step_tokens)` for each batch.",
    ("weighted-average-mismatch", "Fabric"):
        "Count the step's tokens once before the window and call "
        "`fabric.backward(loss_sum / step_tokens)` for each micro-batch (`fabric.backward` "
        "does not divide).",
    ("step-per-microbatch", "HF Trainer"):
        "Let the Trainer step: it steps once per gradient_accumulation_steps batches; remove "
        "any `optimizer.step()` from `compute_loss`, a `training_step` override or a callback.",
    ("zero-grad-inside-accumulation", "HF Trainer"):
        "Remove `zero_grad()` from `compute_loss`, a `training_step` override or a callback: "
        "the Trainer clears the gradients after each optimizer step.",
    ("step-per-microbatch", "accelerate"):
        "Hand the optimizer to `accelerator.prepare` and call it inside `with "
        "accelerator.accumulate(model):` with `Accelerator(gradient_accumulation_steps=K)`: the "
        "prepared optimizer steps only when `accelerator.sync_gradients` is true.",
    ("step-per-microbatch", "Lightning"):
        "In manual optimization step under the window condition: `if (batch_idx + 1) % N == "
        "0: opt.step(); opt.zero_grad()` (or let automatic optimization step with "
        "`Trainer(accumulate_grad_batches=N)`).",
    ("step-per-microbatch", "Fabric"):
        "Step only at the window's end: `if not is_accumulating: optimizer.step(); "
        "optimizer.zero_grad()`, with `is_accumulating = (i + 1) % K != 0`.",
    ("zero-grad-inside-accumulation", "accelerate"):
        "Call `optimizer.zero_grad()` on the prepared optimizer inside `accelerator.accumulate("
        "model)` (it clears only when `sync_gradients` is true), never on the raw optimizer or "
        "the model between micro-batches.",
    ("zero-grad-inside-accumulation", "Lightning"):
        "In manual optimization call `opt.zero_grad()` only under `if (batch_idx + 1) % N == "
        "0:`, after `opt.step()`.",
    ("zero-grad-inside-accumulation", "Fabric"):
        "Call `optimizer.zero_grad()` only after the window's `optimizer.step()` (`if not "
        "is_accumulating:`).",
    ("scheduler-per-microbatch", "accelerate"):
        "Hand the scheduler to `accelerator.prepare(model, optimizer, scheduler)`: the prepared "
        "scheduler steps only when the optimizer really stepped, once per window.",
    ("scheduler-per-microbatch", "Lightning"):
        "Return the scheduler from `configure_optimizers` with `'interval': 'step'` and let "
        "Lightning step it per optimizer step; in manual optimization call `sch.step()` under "
        "`if (batch_idx + 1) % N == 0:`.",
    ("scheduler-per-microbatch", "HF Trainer"):
        "Let the Trainer step its scheduler (`lr_scheduler_type`, or `optimizers=(opt, "
        "sched)`): it steps once per optimizer step; a callback must not call "
        "`scheduler.step()` on `on_substep_end`.",
    ("scheduler-per-microbatch", "Fabric"):
        "Step the scheduler with the optimizer, once per window: `if not is_accumulating: "
        "optimizer.step(); scheduler.step(); optimizer.zero_grad()`.",
    ("double-average", "DeepSpeed"):
        "Remove your own division: `engine.backward(loss)` divides by the config's "
        "gradient_accumulation_steps itself (`scale_wrt_gas=True`), so backward the "
        "micro-batch's mean loss as it is (or pass `scale_wrt_gas=False` and divide once).",
    ("missing-accumulation-average", "DeepSpeed"):
        "Let the engine divide: call `engine.backward(loss)` with its default "
        "`scale_wrt_gas=True`; with `scale_wrt_gas=False` the loop must divide by K itself.",
    ("scheduler-per-microbatch", "DeepSpeed"):
        "Let the engine step the schedule: give it to `deepspeed.initialize(lr_scheduler=...)` "
        "or the config's `scheduler`, and call only `engine.step()` (it steps the scheduler "
        "once per optimizer step); remove the loop's own `scheduler.step()`.",
}


#: The skip-aware scheduler step in a framework's own terms (the catalogue's fix otherwise).
SKIP_AWARE_FIX = {
    "accelerate": "Hand the scheduler to `accelerator.prepare(...)` with the optimizer: the "
                  "prepared scheduler steps only when the prepared optimizer really stepped "
                  "(`accelerator.optimizer_step_was_skipped` tells a hand-written loop).",
}
