"""A warning under FSDP2: the loop never switches gradient sync off, so every micro-batch's
backward reduce-scatters (torchtitan's default for gradient accumulation).

The update is right: each backward reduces its gradient into the sharded `.grad`, which
accumulates over the window. The trade: K reduce-scatters per optimizer step instead of one,
for not holding the unsharded gradient accumulated over the window between micro-batches.
Outside FSDP the loop is an ordinary healthy accumulation loop."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    model.train()
    for i, (inputs, targets) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(inputs).float(), targets) / K
        scaler.scale(loss).backward()  # BUG: missing-no-sync
        if (i + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
