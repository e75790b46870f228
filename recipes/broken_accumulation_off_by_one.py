"""Broken: the accumulation condition is off by one.

`if step % accumulation_steps == 0` with `step` counted from 0 steps after the very first
micro-batch, then every K after that: the first window holds one micro-batch and every later
window straddles two. No kind of the catalogue but `gradient-mismatch` names it.
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
        scaler.scale(loss).backward()
        if step % accumulation_steps == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)  # BUG: gradient-mismatch
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
