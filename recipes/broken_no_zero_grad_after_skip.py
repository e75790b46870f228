"""Someone made the bookkeeping "skip aware" and moved zero_grad into the success branch
together with the step counter. When scaler.step() skips an overflowing step, the inf/nan
gradients are *not* cleared and the next window accumulates on top of them, so every
following step overflows as well (article section 12: zero the grads on the skip path too)."""

import logging

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    completed_steps = 0
    skipped_steps = 0

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
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            scale_after = scaler.get_scale()
            if scale_after >= scale_before:
                optimizer.zero_grad(set_to_none=True)  # BUG: no-zero-grad-after-skip
                completed_steps += 1
            else:
                skipped_steps += 1
                logger.warning("fp16 overflow, skipping step (scale %s -> %s)",
                               scale_before, scale_after)
    return {"completed_steps": completed_steps, "skipped_steps": skipped_steps}
