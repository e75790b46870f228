"""Accumulation was bolted onto a loop that used to step every batch: the step moved under
`if (step + 1) % accum == 0`, but nobody divided the loss by the number of accumulated
micro-batches, so every optimizer step uses the *sum* of K mean gradients (K x too large)."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    accum = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            pred = model(x)
            loss = criterion(pred.float(), y)
        scaler.scale(loss).backward()  # BUG: missing-accumulation-average

        if (step + 1) % accum == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
