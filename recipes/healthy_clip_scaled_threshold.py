"""Healthy: clipping *scaled* gradients against a *scaled* threshold, as PyTorch's own GradScaler
tests do (test_grad_scaling_clipping): `clip_grad_norm_(params, max_norm * scaler.get_scale())`
before any unscale_. Since every gradient and the threshold carry the same factor S, the clip
coefficient max_norm*S / (norm*S) is the true-space one; scaler.step() then unscales."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    max_norm = run.max_grad_norm
    loss_fn = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    for i, (input, target) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            output = model(input)
            loss = loss_fn(output.float(), target)
        scaler.scale(loss / K).backward()
        if (i + 1) % K == 0:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
