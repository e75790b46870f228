"""The learning rate set by hand on every micro-batch from a fractional optimizer step, as MAE's
`lr_sched.adjust_learning_rate(optimizer, data_iter_step / len(data_loader) + epoch, args)` does
when called on every iteration: a linear warm-up read at `it / K`. Each step uses the rate of its
window's last micro-batch, less than one step of the schedule after the rate the same loop at
K = 1 gives it: not a schedule counted in micro-batches (healthy). The last step compared has no
step after it in the K = 1 run; the schedule's pace stands in for it (it was flagged before)."""

import torch
import torch.nn as nn

LEARNING_RATE = 0.05
WARMUP_STEPS = 10


def adjust_learning_rate(optimizer, step):
    lr = LEARNING_RATE * min(1.0, step / WARMUP_STEPS)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    return lr


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for it, (x, y) in enumerate(micro_batches):
        adjust_learning_rate(optimizer, it / K + 1)
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (it + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
