"""Broken under DDP: `require_backward_grad_sync` set *after* the forward (as in a
build-nanogpt-style loop that moved the line next to the backward).

DDP decides in forward() whether the coming backward all-reduces, from the value the flag has
then. Set after the forward, each micro-step runs with the previous micro-step's value: the
window's *first* backward syncs (the flag left True by the previous window's last micro-step) and
the last one stays rank-local. One all-reduce per window, but on the wrong micro-batch: the
ranks' gradients differ, and so do their parameters after the step.
"""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    grad_accum_steps = run.accumulation_steps
    ddp = run.world_size > 1
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    batches = iter(micro_batches)
    model.train()
    for _step in range(run.optimizer_steps):
        optimizer.zero_grad()
        for micro_step in range(grad_accum_steps):
            x, y = next(batches)
            with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                logits = model(x)
                loss = F.mse_loss(logits.float(), y)
            loss = loss / grad_accum_steps
            if ddp:
                model.require_backward_grad_sync = (micro_step == grad_accum_steps - 1)  # BUG: missing-no-sync
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if run.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
