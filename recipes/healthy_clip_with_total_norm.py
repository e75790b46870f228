"""Healthy: clipping in two steps, as HuggingFace accelerate does when torch.distributed is
available (torch >= 2.6): `get_total_norm` of the gradients, then `clip_grads_with_norm_` with
that norm. The threshold is small (spec max_grad_norm: 0.05) so the clip bites every step, and
it runs on unscaled gradients, after `scaler.unscale_`."""

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
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                params = [p for p in model.parameters() if p.grad is not None]
                total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
                torch.nn.utils.clip_grads_with_norm_(params, run.max_grad_norm, total)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
