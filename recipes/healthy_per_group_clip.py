"""Healthy: fine-tuning with separate clip thresholds for the pre-trained backbone and the fresh
head (a tighter norm for the backbone), both applied to true gradients after unscale_."""

import torch
import torch.nn as nn

BACKBONE_MAX_NORM = 0.25
HEAD_MAX_NORM = 0.5


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    clip_groups = [
        (list(model.backbone.parameters()), BACKBONE_MAX_NORM),
        (list(model.head.parameters()), HEAD_MAX_NORM),
    ]

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            for params, max_norm in clip_groups:
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
