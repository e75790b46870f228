"""Copy-paste from a non-accumulating loop: `optimizer.zero_grad()` stays at the top of every
iteration, so each micro-batch wipes what the previous ones accumulated. The optimizer step
only sees the last micro-batch's gradient, divided by K."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    for step, batch in enumerate(micro_batches):
        optimizer.zero_grad()  # BUG: zero-grad-inside-accumulation
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            pred = model(x)
            loss = criterion(pred.float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
