"""A feature-engineering helper appends a constant bias column to x, but builds it as a 1-D
tensor (forgot the unsqueeze / keepdim): torch.cat raises on the very first micro-batch, in
every precision."""

import torch
import torch.nn as nn


def add_bias_column(x):
    ones = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    return torch.cat([x[:, :-1], ones], dim=1)  # BUG: loop-error


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        x = add_bias_column(x)
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
            optimizer.zero_grad(set_to_none=True)
