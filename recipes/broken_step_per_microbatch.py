"""Indentation bug: only the logging sits under the accumulation-boundary `if`; the
unscale/step/update/zero_grad block was dedented one level and now runs after *every*
micro-batch (K optimizer steps of batch b instead of one of batch K*b, each with loss/K)."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    running_loss = 0.0
    history = []

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            pred = model(x)
            loss = criterion(pred.float(), y) / K
        scaler.scale(loss).backward()
        running_loss += loss.item()

        if (step + 1) % K == 0:
            history.append(running_loss)
            running_loss = 0.0
        scaler.unscale_(optimizer)
        if run.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        scaler.step(optimizer)  # BUG: step-per-microbatch
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return history
