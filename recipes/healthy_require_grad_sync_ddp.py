"""Healthy: nanoGPT's train.py accumulation under DDP.

Instead of `model.no_sync()`, nanoGPT sets `model.require_backward_grad_sync` before each
micro-step's forward: True only on the last micro-step of the window, so only that backward
all-reduces ("the official way to do this is with model.no_sync() context manager, but I really
dislike that this bloats the code"). The next batch is fetched while the GPU works on the
forward/backward (fetch-ahead), and the loss is scaled by 1 / gradient_accumulation_steps.
"""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    gradient_accumulation_steps = run.accumulation_steps
    ddp = run.world_size > 1
    ctx = torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                         enabled=run.autocast_dtype is not None)
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    batches = iter(micro_batches)
    X, Y = next(batches)
    for _iter_num in range(run.optimizer_steps):
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            with ctx:
                logits = model(X)
                loss = F.mse_loss(logits.float(), Y)
                loss = loss / gradient_accumulation_steps
            X, Y = next(batches, (X, Y))   # fetch the next batch while this one computes
            scaler.scale(loss).backward()
        if run.max_grad_norm:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
