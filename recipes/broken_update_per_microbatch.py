"""scaler.update() was left at the end of the micro-batch body (outside the boundary `if`),
"so the scale adapts as fast as possible". In fp16 the first non-boundary micro-batch has no
inf check recorded yet, and torch raises
AssertionError: No inf checks were recorded prior to update.
(fp32/bf16 run fine: a disabled scaler's update() is a no-op.)"""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
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
            optimizer.zero_grad(set_to_none=True)
        scaler.update()  # BUG: update-per-microbatch
