"""Broken under FSDP2: gradient sync is switched off and never switched back on.

The loop calls `set_requires_gradient_sync(False)` once before training (meaning "accumulate
without communicating") and never turns it on for a window's last micro-batch: no backward
reduce-scatters, the sharded `.grad` stays None on every rank, and `optimizer.step()` has
nothing to apply. No rank ever steps; the unsharded gradient keeps accumulating unseen."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)  # BUG: gradient-mismatch
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    model.train()
    for i, (inputs, targets) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(inputs).float(), targets) / K
        scaler.scale(loss).backward()
        if (i + 1) % K == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
