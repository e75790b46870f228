"""Migrated from apex static loss scaling: the old `--loss-scale 1024` still multiplies the fp16
loss, on top of GradScaler's dynamic scale.
GradScaler's unscale_() only removes its own factor, so (once the scale has backed off far
enough to stop overflowing) the fp16 update is 1024x too large; before that, every step
overflows and is skipped."""

import torch
import torch.nn as nn

STATIC_LOSS_SCALE = 1024.0  # apex-era --loss-scale, "needed for fp16"


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    static_loss_scale = STATIC_LOSS_SCALE if run.precision == "fp16" else 1.0

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            pred = model(x)
            loss = criterion(pred.float(), y) / K
        scaler.scale(loss * static_loss_scale).backward()  # BUG: double-scaling

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
