"""Broken: OneCycleLR sized in optimizer steps (two epochs of the spec's three windows) but
stepped after every micro-batch. The schedule runs K times too fast, and OneCycleLR refuses to
step past total_steps: the loop raises in its second window, after one optimizer step. The
steps before the raise show the cause: scheduler-per-microbatch at the scheduler's step, not a
bare loop-error. Twin: healthy_onecycle_per_window.py."""

import torch
import torch.nn as nn

TOTAL_STEPS = 6   # two epochs of 3 optimizer steps


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05,
                                                    total_steps=TOTAL_STEPS)
    model.train()
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()
        scheduler.step()  # BUG: scheduler-per-microbatch
        if (step + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
