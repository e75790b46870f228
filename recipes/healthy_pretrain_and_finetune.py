"""Healthy: one training script with two entry functions, each with its own GradScaler --
`pretrain` (run on the cluster) and `train_loop` (the fine-tuning loop diagnosed here). Only one
of them ever runs in a process, so there is one loss-scale owner on this loop's path."""

import torch
import torch.nn as nn


def pretrain(model, optimizer, loader, epochs=1):
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(epochs):
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = nn.functional.mse_loss(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
