"""Clipping moved below the step in a refactor: `scaler.step(optimizer)` consumes the gradients,
then `clip_grad_norm_` rescales them -- gradients that are cleared a few lines later. The
update is never clipped; with a gradient norm above max_grad_norm every step is larger than
the loop means (and a loss spike is never contained)."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    grad_norms = []

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            if run.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(  # BUG: gradient-mismatch
                    model.parameters(), run.max_grad_norm)
                grad_norms.append(float(norm))
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return grad_norms
