"""Fine-tuning code that once froze the head zeroes only the backbone after each step: when the
head was unfrozen its gradients kept accumulating across optimizer steps."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    accum = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    model.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / accum
        scaler.scale(loss).backward()

        if (step + 1) % accum == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            model.backbone.zero_grad(set_to_none=True)  # BUG: missing-zero-grad
