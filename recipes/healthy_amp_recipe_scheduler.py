"""Healthy: the PyTorch AMP recipe with gradient accumulation and an LR schedule stepped once
per window, unconditionally, after `scaler.step(optimizer); scaler.update()` -- what the AMP
docs and most training scripts write. A skipped step advances the schedule by one step; with
GradScaler's default settings the scaler skips a few steps while its scale settles and about
one in growth_interval (2000) after that, so the shift is a handful of steps out of the
schedule, not a bug. (broken_scheduler_steps_on_skip is the same call order with a scaler that
keeps skipping after its scale settled.)"""

import math

import torch
import torch.nn as nn

WARMUP_STEPS = 10
TOTAL_STEPS = 100


def warmup_cosine(step):
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / (TOTAL_STEPS - WARMUP_STEPS)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)

    model.train()
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()

        if (i + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
