"""Healthy: a loop written as a generator that yields its metrics after every optimizer step
(a notebook or a progress bar consumes them); ampdoctor must iterate it for it to run."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    window_loss = 0.0
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()
        window_loss += loss.item()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            yield {"step": (step + 1) // K, "loss": window_loss}
            window_loss = 0.0
