"""Broken under DDP: the no_sync condition is off by one.

The loop counts micro-batches from 1 and syncs when `micro_step == accum_steps - 1`: the sync
happens on the window's second-to-last backward, and the last micro-batch's gradient stays
rank-local. One all-reduce per window, the ranks drift apart.
"""

import contextlib

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    accum_steps = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    model.train()
    micro_step = 0
    for x, y in micro_batches:
        micro_step += 1
        sync = micro_step == accum_steps - 1
        no_sync = getattr(model, "no_sync", contextlib.nullcontext)
        with contextlib.nullcontext() if sync else no_sync():  # BUG: missing-no-sync
            with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                loss = F.mse_loss(model(x).float(), y) / accum_steps
            scaler.scale(loss).backward()
        if micro_step == accum_steps:
            scaler.unscale_(optimizer)
            if run.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            micro_step = 0
