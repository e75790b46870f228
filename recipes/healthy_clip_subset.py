"""Healthy: only the randomly initialised head is clipped (the backbone is left alone), on true
gradients after unscale_."""

import torch
import torch.nn as nn

HEAD_MAX_NORM = 0.35


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
            torch.nn.utils.clip_grad_norm_(model.head.parameters(), HEAD_MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
