"""Healthy: the learning rate set by hand from the optimizer-step counter (nanoGPT's shape:
`lr = get_lr(iter_num)` at the top of each iteration, one iteration being K micro-batches and
one optimizer step). The rate is assigned on every micro-batch, but it only changes at a
window's boundary."""

import math

import torch
import torch.nn as nn

LEARNING_RATE = 1e-3
MIN_LR = 1e-4
WARMUP_ITERS = 2
LR_DECAY_ITERS = 10


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
    iter_num = 0
    for micro_step, (x, y) in enumerate(micro_batches):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(iter_num)
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (micro_step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
