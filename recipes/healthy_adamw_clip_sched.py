"""Healthy: AdamW + gradient clipping + a linear-warmup LambdaLR stepped once per *successful*
optimizer step (the same check accelerate uses: a step was skipped iff the scale went down
across `update()`)."""

import contextlib

import torch
import torch.nn as nn

WARMUP_STEPS = 10


def warmup_lambda(optimizer_step):
    return min(1.0, (optimizer_step + 1) / WARMUP_STEPS)


def train_loop(model, optimizer, micro_batches, run):
    accumulation_steps = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda)
    autocast_kwargs = dict(device_type=run.device_type, dtype=run.autocast_dtype,
                           enabled=run.autocast_dtype is not None)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    completed_steps = 0
    for step, batch in enumerate(micro_batches):
        x, y = batch
        sync_gradients = (step + 1) % accumulation_steps == 0
        ctx = (model.no_sync() if hasattr(model, "no_sync") and not sync_gradients
               else contextlib.nullcontext())
        with ctx:
            with torch.autocast(**autocast_kwargs):
                pred = model(x)
                loss = criterion(pred.float(), y)
            loss = loss / accumulation_steps
            scaler.scale(loss).backward()

        if not sync_gradients:
            continue

        scaler.unscale_(optimizer)
        if run.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        step_was_skipped = scaler.get_scale() < scale_before
        optimizer.zero_grad(set_to_none=True)
        if not step_was_skipped:
            scheduler.step()
            completed_steps += 1
