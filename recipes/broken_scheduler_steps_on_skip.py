"""The textbook call order -- `scaler.step(optimizer); scaler.update(); scheduler.step()` every
window -- with a GradScaler that keeps skipping after its scale settled: growth_interval=1
doubles the scale after every good step, so every other step overflows again. Each skipped
step leaves the parameters where they were, but the scheduler advances anyway (article
section 12): at a steady skip rate r the schedule runs 1/(1-r) times too fast, and the decay
reaches its end while a fraction r of its updates never happened."""

import math

import torch
import torch.nn as nn

TOTAL_STEPS = 8


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, growth_interval=1,
                                  enabled=run.precision == "fp16")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / TOTAL_STEPS))))

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
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()  # BUG: scheduler-steps-on-skip
            optimizer.zero_grad(set_to_none=True)
