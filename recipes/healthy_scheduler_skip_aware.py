"""Healthy (article section 12): the LR schedule follows *successful* optimizer steps only.
A step whose gradients overflowed is skipped by scaler.step(); we detect it by the scale
dropping across update(), count it, and do not advance the scheduler. Gradients are zeroed
on both paths."""

import math

import torch
import torch.nn as nn


def make_scheduler(optimizer, total_steps, warmup_steps=4):
    def lr_lambda(s):
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    micro_batches = list(micro_batches)
    total_steps = len(micro_batches) // K
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    scheduler = make_scheduler(optimizer, total_steps)
    stats = {"optimizer_steps": 0, "skipped_steps": 0, "scheduler_steps": 0, "scale": []}

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            out = model(x)
            loss = criterion(out.float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K != 0:
            continue
        scaler.unscale_(optimizer)
        if run.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        scale_after = scaler.get_scale()
        stats["scale"].append(scale_after)
        optimizer.zero_grad(set_to_none=True)
        if scale_after < scale_before:
            stats["skipped_steps"] += 1
        else:
            stats["optimizer_steps"] += 1
            scheduler.step()
            stats["scheduler_steps"] += 1
    return stats
