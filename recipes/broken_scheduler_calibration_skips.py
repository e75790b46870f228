"""The textbook call order -- `scaler.step(optimizer); scaler.update(); scheduler.step()` every
window -- with a GradScaler that starts above the scale this model's gradients fit in fp16
(init_scale 2**20): the first two steps overflow while the scale settles, and the scheduler
advances on both. That is a constant shift of two steps on a schedule of a thousand, which
changes no real update's learning rate beyond the fp16 tolerance: a warning with the count, not
a failure (skips that go on after the scale settled are: broken_scheduler_steps_on_skip)."""

import math

import torch
import torch.nn as nn

TOTAL_STEPS = 1000


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, init_scale=2.0 ** 20,
                                  enabled=run.precision == "fp16")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / TOTAL_STEPS))))

    model.train()
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()

        if (i + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()  # BUG: scheduler-steps-on-skip (warning: calibration skips)
            optimizer.zero_grad(set_to_none=True)
