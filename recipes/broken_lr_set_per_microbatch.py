"""The learning rate is set by hand from an iteration counter (nanoGPT's `get_lr(it)` shape,
with `for param_group in optimizer.param_groups: param_group["lr"] = lr`), but the counter
counts micro-batches: the warm-up ends after WARMUP_ITERS / K optimizer steps and every step
uses the rate meant for a later one. There is no scheduler object to count: the rate changes
between the micro-batches of one window, which the step state machine never allows."""

import math

import torch
import torch.nn as nn

LEARNING_RATE = 1e-3
MIN_LR = 1e-4
WARMUP_ITERS = 8
LR_DECAY_ITERS = 40


def get_lr(it):
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    ratio = min(1.0, (it - WARMUP_ITERS) / (LR_DECAY_ITERS - WARMUP_ITERS))
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for it, (x, y) in enumerate(micro_batches):
        lr = get_lr(it)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr  # BUG: scheduler-per-microbatch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (it + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
