"""Healthy: the loop peeks one micro-batch ahead so it knows, before the backward, whether the
current micro-batch closes the accumulation window (the window is full, or the stream has ended)
-- the pattern used to decide `no_sync` / `sync_gradients` when the loader's length is unknown.
It steps on the window's last backward."""

import contextlib

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    it = iter(micro_batches)
    nxt = next(it, None)
    i = 0
    while nxt is not None:
        x, y = nxt
        nxt = next(it, None)  # peek: is there anything after this one?
        is_last = nxt is None or (i + 1) % K == 0
        sync = (model.no_sync() if hasattr(model, "no_sync") and not is_last
                else contextlib.nullcontext())
        with sync:
            with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                loss = criterion(model(x).float(), y)
            scaler.scale(loss / K).backward()
        if is_last:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        i += 1
