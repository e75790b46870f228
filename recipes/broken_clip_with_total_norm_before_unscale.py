"""Clip before unscale, in two steps: `get_total_norm` then `clip_grads_with_norm_` (the path
HuggingFace accelerate takes when torch.distributed is available) right after the K backwards,
leaving the unscaling to scaler.step(). In fp16 the norm is that of gradients multiplied by the
loss scale (~65536), so every step is clipped to max_norm in scaled space and the update is
~1/scale of what it should be."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            pred = model(x)
            loss = criterion(pred.float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            if run.max_grad_norm is not None:
                params = [p for p in model.parameters() if p.grad is not None]
                total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
                torch.nn.utils.clip_grads_with_norm_(params, run.max_grad_norm, total)  # BUG: clip-before-unscale
            scaler.step(optimizer)  # unscales internally -- too late for the clip above
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
