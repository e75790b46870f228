"""Broken under FSDP2: a window's sync is switched on one micro-batch early.

The loop turns gradient sync on when `i % K == K - 2` (it thought in 1-based micro-steps): the
second-to-last backward reduce-scatters, the last one's gradient stays unsharded and local until
the next window's sync, and this window's update misses it."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    fsdp = hasattr(model, "set_requires_gradient_sync")
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    model.train()
    for i, (inputs, targets) in enumerate(micro_batches):
        is_last_microbatch = (i + 1) % K == 0
        if fsdp:
            model.set_requires_gradient_sync(i % K == K - 2)  # BUG: missing-no-sync
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(inputs).float(), targets) / K
        scaler.scale(loss).backward()
        if is_last_microbatch:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
