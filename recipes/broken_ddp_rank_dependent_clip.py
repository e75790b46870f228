"""Broken under DDP: one rank clips, the others do not.

A "log and clip on the main process" refactor moved the clip under `if rank == 0`: rank 0 steps
with a clipped gradient, rank 1 with the raw one. One all-reduce per window on the last backward,
and yet the ranks' parameters drift apart from the first step.
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
        ctx = model.no_sync() if (hasattr(model, "no_sync") and not last) else contextlib.nullcontext()
        with ctx:
            with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                loss = F.mse_loss(model(x).float(), y) / K
            scaler.scale(loss).backward()
        if last:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None and run.rank == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)  # BUG: gradient-mismatch
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
