"""Broken under HSDP (FSDP2 on a 2-D mesh: shard inside a node, replicate across nodes): the
all-reduce across the replicas is switched off and never switched back on.

`set_requires_all_reduce(False)` is HSDP's way to accumulate with reduce-scatters inside a
node only, all-reducing across the nodes on a window's last micro-batch. This loop turns it off
once before training and never on: FSDP2 holds every reduce-scatter's output aside waiting for
an all-reduce that never comes, the sharded `.grad` stays None, and no rank ever steps."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    if hasattr(model, "set_requires_all_reduce"):
        model.set_requires_all_reduce(False)  # BUG: gradient-mismatch
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
