"""A loop ported from fp32 code: the backward goes through the scaler, but the window ends with
the old `optimizer.step()` followed by `scaler.update()`. The step applies gradients still
multiplied by the loss scale (65536x) with no inf check; torch then refuses the update."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (step + 1) % K == 0:
            optimizer.step()  # BUG: missing-unscale
            scaler.update()
            optimizer.zero_grad()
