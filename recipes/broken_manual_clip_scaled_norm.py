"""The loop logs the global gradient norm at the end of every window, and someone reused that
number to clip by hand, "to avoid computing the norm twice". The norm is read before
scaler.unscale_(), so it is S times the true norm: the clip coefficient is S times too small
and every update is 1/S of the clipped update it should be."""

import torch
import torch.nn as nn


def global_norm(parameters):
    return torch.linalg.vector_norm(
        torch.stack([p.grad.detach().norm() for p in parameters if p.grad is not None]))


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            grad_norm = float(global_norm(params))  # BUG: clip-before-unscale
            norms.append(grad_norm)
            scaler.unscale_(optimizer)
            clip_coef = run.max_grad_norm / (grad_norm + 1e-6)
            if clip_coef < 1.0:
                for p in params:
                    p.grad.mul_(clip_coef)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return norms
