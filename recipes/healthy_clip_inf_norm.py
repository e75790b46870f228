"""Healthy: clipping by the max-norm (`norm_type=inf`: the largest absolute gradient element)
at run.max_grad_norm, on true gradients after unscale_."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm,
                                               norm_type=float('inf'))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
