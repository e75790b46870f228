"""A refactor moved the `/ gradient_accumulation_steps` into compute_loss(), but the
training loop still divides by it as well: the gradient is averaged twice (K x too small)."""

import torch
import torch.nn as nn

_criterion = nn.MSELoss()


def compute_loss(model, batch, gradient_accumulation_steps):
    x, y = batch
    pred = model(x)
    loss = _criterion(pred.float(), y)
    # Normalise here so every caller gets a loss ready for accumulation.
    return loss / gradient_accumulation_steps


def train_loop(model, optimizer, micro_batches, run):
    gradient_accumulation_steps = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = compute_loss(model, batch, gradient_accumulation_steps)
        loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()  # BUG: double-average

        if (step + 1) % gradient_accumulation_steps == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
