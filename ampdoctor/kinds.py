"""The catalogue of diagnosis kinds (`KINDS`, by name `CATALOGUE`): what each means, why it
matters and how to fix it (`ampdoctor explain KIND` prints it), and the rule table (`RULES`):
what each kind's `evidence.measured` counts and its one decider (`decided_in`, an importable
`module:function` in `ampdoctor.deciders`).

This module must not import torch: `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .enums import KindId


@dataclass(frozen=True)
class Kind:
    """One diagnosis kind: what it is, why it matters, and the fix."""

    name: KindId
    title: str
    why: str
    fix: str
    example: str = ""


#: Every diagnosis kind, in the order `ampdoctor explain` lists them.
KINDS: tuple[Kind, ...] = (
    Kind(
        KindId.NONDETERMINISTIC_BASELINE,
        "The fp32 reference is not repeatable",
        "Two fp32 runs from identical weights and data give different gradients, so any later "
        "difference could be noise. Usually the loop (or the loss) draws random numbers outside "
        "the model's forward, or a random layer runs in a forward ampdoctor could not match to "
        "its micro-batch.",
        "Dropout inside the model is fine (`dropout: align`, the default, gives every forward of "
        "micro-batch i the same random state in every run). Randomness drawn outside the model's "
        "forward cannot be aligned: move it into `forward()` (e.g. a `GaussianNoise` module that "
        "adds `torch.randn_like(x) * std` when `self.training`), derive it from a generator "
        "seeded per micro-batch (`torch.Generator().manual_seed(step)`), or switch it off for "
        "the triage; `dropout: off` in the spec sets every dropout to p=0.",
        "for x, y in micro_batches:\n"
        "    x = x + 0.01 * torch.randn_like(x)    # augmentation drawn in the loop\n"
        "    with torch.autocast(run.device_type, dtype=run.autocast_dtype,\n"
        "                        enabled=run.autocast_dtype is not None):\n"
        "        loss = criterion(model(x), y) / K",
    ),
    Kind(
        KindId.MISSING_ACCUMULATION_AVERAGE,
        "The loss is not divided by the accumulation steps",
        "K micro-batch gradients are summed, so the optimizer sees K times the full-batch "
        "gradient: "
        "the effective learning rate is K times too large (and Adam hides it, clipping masks it).",
        "Divide each micro-batch loss by `accumulation_steps` before backward: "
        "`loss = criterion(out, y) / accumulation_steps`, then `scaler.scale(loss).backward()`. "
        "A hard-coded divisor must be K itself (`gradient_accumulation_steps`), not a constant.",
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    with torch.autocast(\"cuda\", dtype=torch.float16):\n"
        "        loss = criterion(model(x), y)      # no / K\n"
        "    scaler.scale(loss).backward()\n"
        "    if (i + 1) % K == 0:\n"
        "        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()",
    ),
    Kind(
        KindId.DOUBLE_AVERAGE,
        "The gradient is averaged twice",
        "The loss is divided by K and the gradient (or the loss again) is divided by K once more, "
        "so the update is K times too small. Under DDP: the loss divided by the world size on "
        "top of DDP's own averaging over ranks. A hard-coded divisor larger than K (`/ 8` for "
        "K=4) is reported the same way.",
        "Average exactly once: keep `loss = criterion(out, y) / accumulation_steps` and delete "
        "the second division (`p.grad /= K`, `loss / K` a second time, `/ dist.get_world_size()` "
        "under DDP, which already averages over ranks).",
        "loss = criterion(model(x), y) / K\n"
        "scaler.scale(loss).backward()\n"
        "if (i + 1) % K == 0:\n"
        "    scaler.unscale_(optimizer)\n"
        "    for p in model.parameters():\n"
        "        p.grad /= K                       # averaged a second time\n"
        "    scaler.step(optimizer); scaler.update(); optimizer.zero_grad()",
    ),
    Kind(
        KindId.REDUCTION_MISMATCH,
        "The loss reduction does not match the averaging factor",
        "The loss sums over samples or tokens (`reduction='sum'`, `.sum()`) while the loop "
        "divides only by K, so the gradient is scaled by the number of samples (or tokens) per "
        "micro-batch; when that count changes from step to step, so does the effective learning "
        "rate.",
        "Use `reduction='mean'` and divide by K: `loss = F.cross_entropy(logits, y) / K`. Or keep "
        "the sum and divide by the sample/token count of the whole optimizer step, counted once "
        "over all K micro-batches before the window: `loss = loss_sum / step_count`.",
        "criterion = nn.CrossEntropyLoss(reduction=\"sum\")\n"
        "...\n"
        "loss = criterion(model(x), y) / K          # a sum over b samples, / K only\n"
        "scaler.scale(loss).backward()",
    ),
    Kind(
        KindId.WEIGHTED_AVERAGE_MISMATCH,
        "Micro-batches are weighted equally although the loss is token/sample weighted",
        "Each micro-batch loss is a weighted mean over its own tokens, then the K means are "
        "averaged "
        "with equal weight. When micro-batches hold different numbers of tokens this is not the "
        "weighted mean over the whole step: short micro-batches count too much.",
        "Count the step's tokens once before the window (`n = sum((mb['labels'] != -100).sum() "
        "for mb in window)`) and backward `loss_sum / n` for each micro-batch, with `loss_sum = "
        "F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, "
        "reduction='sum')`. In the spec, let `loss` return `(loss_sum, weight_sum)`.",
        "for i, batch in enumerate(micro_batches):\n"
        "    out = model(batch[\"input_ids\"], labels=batch[\"labels\"])\n"
        "    loss = out.loss / K    # mean over its own tokens; each micro-batch 1/K\n"
        "    scaler.scale(loss).backward()",
    ),
    Kind(
        KindId.STEP_PER_MICROBATCH,
        "The optimizer steps on every micro-batch",
        "The optimizer steps K times per window instead of once: each update uses one micro-batch, "
        "the effective batch is b instead of K*b and the scheduler and scaler run K times too "
        "fast.",
        "Put the whole step under the window condition: `if (i + 1) % accumulation_steps == 0:` "
        "then `scaler.unscale_(opt)`, clip, `scaler.step(opt)`, `scaler.update()`, "
        "`opt.zero_grad()`.",
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    scaler.step(optimizer)                # every micro-batch\n"
        "    scaler.update()\n"
        "    if (i + 1) % K == 0:\n"
        "        optimizer.zero_grad()",
    ),
    Kind(
        KindId.ZERO_GRAD_INSIDE_ACCUMULATION,
        "Gradients are zeroed inside the accumulation window",
        "`zero_grad` runs before the window is complete, so only the last micro-batch(es) reach "
        "the "
        "optimizer step; the other K-1 are thrown away.",
        "Call `optimizer.zero_grad(set_to_none=True)` once per window, right after "
        "`scaler.update()` (or before the window's first micro-batch: `if i % K == 0:`), never "
        "between the micro-batches of a window.",
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    optimizer.zero_grad()                 # wipes the window so far\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    if (i + 1) % K == 0:\n"
        "        scaler.step(optimizer); scaler.update()",
    ),
    Kind(
        KindId.MISSING_NO_SYNC,
        "DDP/FSDP synchronises gradients on the wrong micro-batches",
        "Without `no_sync()` (or `require_backward_grad_sync = False`, or FSDP's "
        "`set_requires_gradient_sync(False)`) on the first K-1 micro-batches, DDP all-reduces K "
        "times per optimizer step: K times the communication for the same result. With the "
        "switch one micro-batch off (set after the forward, an off-by-one condition), the one "
        "sync of a window happens on another backward: the later micro-batches' gradients stay "
        "rank-local, the ranks consume different gradients and their parameters drift apart "
        "(under FSDP2 they are carried into the next window's update). Under FSDP2 a "
        "reduce-scatter on every micro-batch with a right update is a documented trade (K times "
        "the communication for not holding the unsharded accumulated gradient): a warning.",
        "Switch sync off for the first K-1 micro-batches and on for the last, *before* each "
        "forward: `with model.no_sync():` around forward and backward, or "
        "`model.require_backward_grad_sync = (micro_step == K - 1)` before the forward "
        "(FSDP2: `model.set_requires_gradient_sync(micro_step == K - 1)`).",
        "model = DDP(model)\n"
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    loss = criterion(model(x), y) / K\n"
        "    model.require_backward_grad_sync = (i % K == K - 1)  # after forward: late\n"
        "    loss.backward()",
    ),
    Kind(
        KindId.HALF_OPEN_AMP,
        "Mixed precision is only half switched on (or off)",
        "The precision the run asks for and what the code does disagree: a GradScaler left enabled "
        "in bf16, autocast never entered, autocast with another dtype, fp16 without a scaler, or "
        "a loop that casts the model's weights to fp16/bf16 (no fp32 master weights).",
        "Branch on the precision in one place: `scaler = torch.amp.GradScaler(device_type, "
        "enabled=(precision == 'fp16'))` and `torch.autocast(device_type, dtype=amp_dtype, "
        "enabled=amp_dtype is not None)` with `amp_dtype` float16 for fp16, bfloat16 for bf16, "
        "None for fp32 (in the triage: `run.autocast_dtype`).",
        "scaler = torch.amp.GradScaler(\"cuda\")                # enabled in bf16 too\n"
        "for x, y in micro_batches:\n"
        "    with torch.autocast(\"cuda\", dtype=torch.float16):  # fp16 in every run\n"
        "        loss = criterion(model(x), y) / K\n"
        "    scaler.scale(loss).backward()",
    ),
    Kind(
        KindId.CLIP_BEFORE_UNSCALE,
        "Gradients are clipped while still scaled",
        "`clip_grad_norm_` runs before `scaler.unscale_`, so it sees gradients multiplied by the "
        "loss "
        "scale S: the threshold is effectively max_norm*S in true-gradient space, or the update is "
        "crushed by 1/S.",
        "Call `scaler.unscale_(optimizer)` right before `torch.nn.utils.clip_grad_norm_(model."
        "parameters(), max_norm)`, then `scaler.step(optimizer)` (it does not unscale again). A "
        "norm computed by hand for clipping or logging must also come after `unscale_`.",
        "scaler.scale(loss).backward()\n"
        "if (i + 1) % K == 0:\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # grads x S\n"
        "    scaler.step(optimizer)              # unscales, too late for the clip\n"
        "    scaler.update()\n"
        "    optimizer.zero_grad()",
    ),
    Kind(
        KindId.MISSING_UNSCALE,
        "An optimizer steps on scaled gradients",
        "The optimizer's `.step()` runs while its gradients are still multiplied by the loss scale "
        "(e.g. a second optimizer stepped directly instead of through `scaler.step`): its update "
        "is S times too large, and overflow is never checked.",
        "Step every optimizer through the scaler: `scaler.unscale_(opt)` (before clipping) and "
        "`scaler.step(opt)` for each one, then `scaler.update()` once per optimizer step; never "
        "`opt.step()` on gradients that `scaler.scale(loss)` produced.",
        "scaler.scale(loss).backward()\n"
        "scaler.unscale_(backbone_opt)\n"
        "scaler.step(backbone_opt)\n"
        "head_opt.step()         # second optimizer: grads still x S, no inf check\n"
        "scaler.update()",
    ),
    Kind(
        KindId.UNSCALE_TWICE,
        "Gradients are unscaled twice",
        "`unscale_` (or a hand-written division by the scale) runs twice on the same gradients in "
        "one optimizer step, so they are divided by S twice.",
        "Call `scaler.unscale_(optimizer)` once per optimizer per step, after the window's last "
        "backward (not per micro-batch), and never divide `.grad` by `scaler.get_scale()` by "
        "hand.",
        "scaler.unscale_(optimizer)\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "inv = 1.0 / scaler.get_scale()\n"
        "for p in model.parameters():\n"
        "    p.grad.mul_(inv)            # unscaled a second time\n"
        "scaler.step(optimizer)",
    ),
    Kind(
        KindId.UPDATE_PER_MICROBATCH,
        "`scaler.update()` runs on every micro-batch",
        "The scale is updated K times per optimizer step, so one overflowing micro-batch backs the "
        "scale off K times and growth happens K times too fast.",
        "Call `scaler.update()` once per optimizer step, right after `scaler.step(optimizer)`, "
        "inside the `if (i + 1) % K == 0:` block.",
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    scaler.update()                       # every micro-batch\n"
        "    if (i + 1) % K == 0:\n"
        "        scaler.step(optimizer)\n"
        "        optimizer.zero_grad()",
    ),
    Kind(
        KindId.DOUBLE_SCALING,
        "Two loss-scale state machines on one loss",
        "The loss is scaled twice (two GradScalers, a GradScaler inside "
        "DeepSpeed/Trainer/accelerate/"
        "Lightning AMP, or a constant loss scale on top of a GradScaler): skips, scale and "
        "clipping "
        "no longer mean anything.",
        "Keep exactly one owner of loss scaling: either the framework's (DeepSpeed `fp16.enabled`, "
        "`TrainingArguments(fp16=True)`, `Accelerator(mixed_precision='fp16')`, Lightning "
        "`precision='16-mixed'`) with no GradScaler of your own, or your GradScaler with the "
        "framework's fp16 off; delete any constant `loss * loss_scale` left from apex-era code.",
        "static_loss_scale = 128.0                     # left over from apex O2\n"
        "scaler = torch.amp.GradScaler(\"cuda\")\n"
        "...\n"
        "scaler.scale(loss * static_loss_scale).backward()",
    ),
    Kind(
        KindId.SCHEDULER_PER_MICROBATCH,
        "The LR scheduler steps on every micro-batch",
        "The scheduler advances K times per optimizer step, so warmup and decay run K times too "
        "fast.",
        "Call `scheduler.step()` once per optimizer step, inside the `if (i + 1) % K == 0:` block "
        "after `scaler.step(optimizer)`; size the schedule in optimizer steps "
        "(`total_steps = len(loader) // K * epochs`).",
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    scheduler.step()                      # K times per optimizer step\n"
        "    if (i + 1) % K == 0:\n"
        "        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()",
    ),
    Kind(
        KindId.SCHEDULER_STEPS_ON_SKIP,
        "The LR scheduler steps when the optimizer step was skipped",
        "GradScaler skipped the update (inf/NaN gradients) but the scheduler still advanced, so "
        "the schedule runs ahead of the real number of updates: by the few calibration skips "
        "while the scale settles (a constant shift), and at a steady skip rate r after that "
        "1/(1 - r) times too fast.",
        "Step the scheduler only when the optimizer stepped: `scale = scaler.get_scale()` before "
        "`scaler.step(optimizer)`; after `scaler.update()`, `if scaler.get_scale() >= scale: "
        "scheduler.step()` (a lower scale means the step was skipped).",
        "if (i + 1) % K == 0:\n"
        "    scaler.step(optimizer)        # may skip on inf/NaN\n"
        "    scaler.update()\n"
        "    scheduler.step()              # advances anyway\n"
        "    optimizer.zero_grad()",
    ),
    Kind(
        KindId.NO_ZERO_GRAD_AFTER_SKIP,
        "Gradients are not cleared after a skipped step",
        "After GradScaler skipped a step, the inf/NaN gradients stay in `.grad` and poison the "
        "next "
        "window, which is skipped too; a hand-written overflow guard that `continue`s past "
        "`scaler.update()` also makes torch refuse the next `unscale_()`.",
        "Run `scaler.update()` and `optimizer.zero_grad(set_to_none=True)` after every "
        "`scaler.step`, skipped or not; drop a hand-written `if not torch.isfinite(norm): "
        "continue` (scaler.step already skips non-finite steps) or make it clear the gradients "
        "and update the scaler too.",
        "scaler.unscale_(optimizer)\n"
        "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "if not torch.isfinite(norm):\n"
        "    continue              # skips update() and zero_grad(): inf stays\n"
        "scaler.step(optimizer)\n"
        "scaler.update()\n"
        "optimizer.zero_grad()",
    ),
    Kind(
        KindId.MISSING_ZERO_GRAD,
        "Gradients are carried from one optimizer step into the next",
        "`.grad` is not cleared after an optimizer step (no `zero_grad`, or one that covers only "
        "part of the model), so every step re-applies the gradients of the windows before it: "
        "the effective learning rate grows with every step, and an overflow, once in `.grad`, "
        "poisons every later window.",
        "Clear every parameter's gradient once per optimizer step, right after the step (skipped "
        "or not): `optimizer.zero_grad(set_to_none=True)` on every optimizer, or "
        "`model.zero_grad()`.",
        "if (i + 1) % K == 0:\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
        "    head.zero_grad()      # clears the head only (or no zero_grad at all)",
    ),
    Kind(
        KindId.FREQUENT_SKIPS,
        "fp16 skips updates too often",
        "Many optimizer steps are skipped for overflow, or the scale collapses: fewer real updates "
        "than the schedule assumes.",
        "Start from GradScaler's defaults (`init_scale=2**16, growth_interval=2000, "
        "backoff_factor=0.5`); if it still skips, look for the overflow source (learning rate, "
        "initialisation, bad data, a loss summed instead of averaged) before tuning the scaler, "
        "or train in bf16.",
        "scaler = torch.amp.GradScaler(\"cuda\", init_scale=2.0 ** 24,\n"
        "                              growth_interval=1)  # grows into overflow",
    ),
    Kind(
        KindId.GRADIENT_MISMATCH,
        "The update differs from the reference in no known shape",
        "The gradient the optimizer consumed differs from the fp32 full-batch reference beyond the "
        "tolerance, and the difference matches none of the known shapes (a factor K, 1/K, b, "
        "S...). "
        "Also reported for an off-by-one window condition, a loop that stops early, and DDP ranks "
        "that consume different gradients.",
        "Compare the loop with the correct skeleton: `loss / K` -> `scaler.scale(loss).backward()` "
        "x K -> `scaler.unscale_` -> clip -> `scaler.step` -> `scaler.update` -> `zero_grad`, "
        "stepping when `(i + 1) % K == 0`; the finding names the first bad step and its numbers.",
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    if i % K == 0:                # off by one: steps after micro-batch 0\n"
        "        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()",
    ),
    Kind(
        KindId.LOOP_ERROR,
        "The training loop raised an error",
        "The loop raised an exception ampdoctor does not recognise as one of the known mistakes "
        "(or hung past `timeout_s`, or a DDP rank raised or hung).",
        "Fix the error at the reported line (`evidence.loop_line` is the loop's own line that "
        "called it; `--debug` prints the full traceback); run the loop alone on the same slice to "
        "reproduce it. For a timeout that is only slowness, raise `timeout_s` in the spec.",
        "for x, y in micro_batches:\n"
        "    with torch.autocast(run.device_type, dtype=run.autocast_dtype,\n"
        "                        enabled=run.autocast_dtype is not None):\n"
        "        x = torch.cat([x[:, :-1], torch.ones(len(x), 2)], 1)  # wrong width\n"
        "        loss = criterion(model(x), y) / K",
    ),
)

#: kind name -> its entry.
CATALOGUE: dict[str, Kind] = {k.name: k for k in KINDS}


@dataclass(frozen=True)
class Rule:
    """Where a kind is decided and what its `evidence.measured` counts (the rule table: find a
    kind here, then open its decider)."""

    kind: KindId
    measured: str
    #: the one function that builds this kind's findings, importable as `module:function`
    decided_in: str


#: kind -> rule, the way ruff keeps one code -> rule table. Each kind has one decider (in
#: `ampdoctor/deciders.py`) that every path reaching the kind calls with what it observed; grep
#: the decider's name (`deciders.double_average`) for those paths. The judge
#: (`ampdoctor/judge.py`) decides that an update is wrong; the rules under `rules/` say which
#: shape the mismatch has (or, for a rung that judges a trajectory or a count of messages, the
#: rung measures it). tests/test_rules_table.py checks, by reading the source, that each kind's
#: findings are built in its decider and nowhere else.
RULES: dict[str, Rule] = {r.kind: r for r in [
    Rule(KindId.NONDETERMINISTIC_BASELINE,
         "relative difference of two fp32 runs at the same weights",
         "ampdoctor.deciders:nondeterministic_baseline"),
    Rule(KindId.MISSING_ACCUMULATION_AVERAGE, "consumed / reference gradient norm (K)",
         "ampdoctor.deciders:missing_accumulation_average"),
    Rule(KindId.DOUBLE_AVERAGE, "consumed / reference gradient norm (1/K; under DDP 1/world_size)",
         "ampdoctor.deciders:double_average"),
    Rule(KindId.REDUCTION_MISMATCH, "consumed / reference gradient norm (b, a token count)",
         "ampdoctor.deciders:reduction_mismatch"),
    Rule(KindId.WEIGHTED_AVERAGE_MISMATCH, "consumed / reference gradient norm",
         "ampdoctor.deciders:weighted_average_mismatch"),
    Rule(KindId.STEP_PER_MICROBATCH, "optimizer steps for the run's windows",
         "ampdoctor.deciders:step_per_microbatch"),
    Rule(KindId.ZERO_GRAD_INSIDE_ACCUMULATION, "micro-batches of the window that reached the step",
         "ampdoctor.deciders:zero_grad_inside_accumulation"),
    Rule(KindId.MISSING_NO_SYNC, "syncs per window (bytes), the backward that synced, rank drift",
         "ampdoctor.deciders:missing_no_sync"),
    Rule(KindId.HALF_OPEN_AMP, "autocast entered/enabled (dtype)",
         "ampdoctor.deciders:half_open_amp"),
    Rule(KindId.CLIP_BEFORE_UNSCALE, "norm the clip saw / true norm (the loss scale S)",
         "ampdoctor.deciders:clip_before_unscale"),
    Rule(KindId.MISSING_UNSCALE,
         "consumed / reference gradient norm (S); steps on non-finite grads",
         "ampdoctor.deciders:missing_unscale"),
    Rule(KindId.UNSCALE_TWICE, "unscale_ calls per step, or consumed / reference (1/S)",
         "ampdoctor.deciders:unscale_twice"),
    Rule(KindId.UPDATE_PER_MICROBATCH, "scale backoffs for one overflowing window",
         "ampdoctor.deciders:update_per_microbatch"),
    Rule(KindId.DOUBLE_SCALING, "effective loss scale; loss-scale owners on one path",
         "ampdoctor.deciders:double_scaling"),
    Rule(KindId.SCHEDULER_PER_MICROBATCH,
         "scheduler steps per optimizer step (LR off the schedule)",
         "ampdoctor.deciders:scheduler_per_microbatch"),
    Rule(KindId.SCHEDULER_STEPS_ON_SKIP, "steady skip rate the scheduler advanced on",
         "ampdoctor.deciders:scheduler_steps_on_skip"),
    Rule(KindId.NO_ZERO_GRAD_AFTER_SKIP, "windows skipped after the injected one",
         "ampdoctor.deciders:no_zero_grad_after_skip"),
    Rule(KindId.FREQUENT_SKIPS, "fraction of fp16 steps skipped",
         "ampdoctor.deciders:frequent_skips"),
    Rule(KindId.MISSING_ZERO_GRAD, "parameters whose .grad carried over a step",
         "ampdoctor.deciders:missing_zero_grad"),
    Rule(KindId.GRADIENT_MISMATCH, "consumed / reference gradient norm, first bad step",
         "ampdoctor.deciders:gradient_mismatch"),
    Rule(KindId.LOOP_ERROR, "the exception the loop raised",
         "ampdoctor.deciders:loop_error"),
]}
