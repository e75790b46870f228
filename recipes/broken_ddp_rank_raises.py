"""Broken under DDP: one rank raises in the middle of a window (a data-dependent check that
fails on rank 1's shard only). The other rank waits in the next all-reduce for a peer that will
never come: a naive launcher hangs until the collective times out (30 minutes by default)."""

import contextlib

import torch
import torch.nn.functional as F


def check_shard(y, rank, index):
    if rank == 1 and index == 5:
        raise ValueError(f"rank {rank}: target out of range in micro-batch {index}")  # BUG: loop-error


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
        check_shard(y, run.rank, i)
        if last:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
