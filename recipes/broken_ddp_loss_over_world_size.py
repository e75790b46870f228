"""Broken under DDP: the loss divided by the world size on top of DDP's own averaging.

DDP already averages the gradients over ranks (all-reduce sum / world_size). Dividing the loss by
`dist.get_world_size()` as well, as a port from a hand-written all-reduce(SUM) loop does, leaves
every rank with 1/world_size of the right gradient.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    model.train()
    for i, (x, y) in enumerate(micro_batches):
        last = (i + 1) % K == 0
        ctx = model.no_sync() if (hasattr(model, "no_sync") and not last) else contextlib.nullcontext()
        with ctx:
            with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                loss = F.mse_loss(model(x).float(), y) / K / world_size
            scaler.scale(loss).backward()  # BUG: double-average
        if last:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
