"""Healthy: clipping with a small threshold (spec max_grad_norm: 0.05) so that it really
clips every step. Clipping happens on unscaled gradients, after the K-th backward."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    grad_norms = []

    model.train()
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            out = model(x)
            loss = criterion(out.float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
                grad_norms.append(float(norm))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return None
