"""A debugging `return` after the first optimizer step ("just check one step runs") was
committed: the run trains on one window and stops, whatever the schedule says."""

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
            scaler.step(optimizer)  # BUG: gradient-mismatch
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            return {"loss": loss.item() * K}
