"""Healthy: the textbook accumulation + AMP loop (plain SGD, no clipping, no scheduler).

Loss is averaged over the K micro-batches before scaling, the scaler is unscaled/stepped/
updated once per optimizer step, and gradients are cleared after the step. Under DDP the
first K-1 micro-batches run inside `no_sync()`.
"""

import contextlib

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    accumulation_steps = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        is_boundary = (step + 1) % accumulation_steps == 0
        sync_ctx = (model.no_sync() if hasattr(model, "no_sync") and not is_boundary
                    else contextlib.nullcontext())
        with sync_ctx:
            with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                pred = model(x)
                loss = criterion(pred.float(), y) / accumulation_steps
            scaler.scale(loss).backward()

        if is_boundary:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
