"""A short linear warm-up (3 optimizer steps) stepped after every micro-batch backward, outside
the accumulation-boundary `if`: with K=4 the warm-up is over before the first optimizer step,
so every step of the warm-up runs at the full learning rate. After the first window the LR no
longer changes, so steps 1, 2, ... look consistent with one another: only the order of the
calls (scheduler steps between the forwards and backwards of a window) and the first step's
learning rate show it."""

import torch
import torch.nn as nn

WARMUP_STEPS = 3


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0 / WARMUP_STEPS, total_iters=WARMUP_STEPS - 1)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()
        scheduler.step()  # BUG: scheduler-per-microbatch

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
