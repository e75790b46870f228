"""Broken under DDP: `no_sync()` wraps only the backward.

DDP reads the flag that no_sync() clears in forward(): the forward ran outside the context, so
the reducer was already armed and the backward all-reduces anyway. Every micro-batch
synchronises: K all-reduces per optimizer step instead of one. The update is right, the
communication K times what it should be.
"""

import contextlib

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    model.train()
    for i, (x, y) in enumerate(micro_batches):
        last = (i + 1) % K == 0
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(x).float(), y) / K
        ctx = model.no_sync() if (hasattr(model, "no_sync") and not last) else contextlib.nullcontext()
        with ctx:  # BUG: missing-no-sync
            scaler.scale(loss).backward()
        if last:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
