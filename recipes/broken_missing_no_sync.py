"""Broken under DDP: every micro-batch's backward all-reduces.

The loop was written for one GPU and later launched with torchrun: nothing wraps the first K-1
backward passes of a window in `model.no_sync()`, so DDP synchronises gradients K times per
optimizer step. The result is the same; the communication is K times what it should be.
"""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    accumulation_steps = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / accumulation_steps
        scaler.scale(loss).backward()  # BUG: missing-no-sync
        if (step + 1) % accumulation_steps == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
