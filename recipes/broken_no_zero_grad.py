"""zero_grad() was lost when the step block was moved into an `if` for accumulation: nothing
ever clears .grad, so every optimizer step re-applies the gradients of every earlier window."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    accum = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / accum
        scaler.scale(loss).backward()

        if (step + 1) % accum == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)  # BUG: missing-zero-grad
            scaler.update()
