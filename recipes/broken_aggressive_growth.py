"""A GradScaler "tuned" to climb fast: growth_factor=16 after every good step
(growth_interval=1). Its first step at the default init_scale goes through, then every growth
overshoots the largest scale this model's gradients fit in fp16 by more than one halving, so it
takes several skipped steps to back off each time: most windows after the first real update
overflow and are dropped, updates the fp32 reference makes."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, growth_factor=16.0, growth_interval=1, enabled=run.precision == "fp16")  # BUG: frequent-skips

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
