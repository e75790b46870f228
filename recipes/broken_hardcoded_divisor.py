"""The accumulation factor was hard-coded when the config said 8 micro-batches per step; the
config later moved to 4 and the literal stayed. The loss is divided by 8 instead of K = 4, so
every optimizer step sees half the gradient it should (an averaging mistake by a factor 2)."""

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
            loss = criterion(model(x).float(), y) / 8
        scaler.scale(loss).backward()  # BUG: double-average

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
