"""An apex-era static loss scale survived the move to torch.amp: under fp16 the loss is still
multiplied by 1024 on its own line, then GradScaler scales it again. unscale_() removes only the
GradScaler's factor, so the gradients are 1024x too large and overflow until the dynamic scale
has backed off by 2^10."""

import torch
import torch.nn.functional as F

STATIC_LOSS_SCALE = 1024.0


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    fp16 = run.precision == "fp16"
    scaler = torch.amp.GradScaler(run.device_type, enabled=fp16)

    model.train()
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(x).float(), y) / K
        if fp16:
            loss = loss * STATIC_LOSS_SCALE  # BUG: double-scaling
        scaler.scale(loss).backward()

        if (i + 1) % K == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
