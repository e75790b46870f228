"""Error B from the article: after the K backwards the loop clips straight away and lets
scaler.step() do the unscaling. In fp16 the clip sees gradients multiplied by the loss scale
(~65536), so the norm is always "too large", every step is clipped to max_norm in scaled
space, and after scaler.step() unscales them the update is ~1/scale of what it should be."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

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
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)  # BUG: clip-before-unscale
            scaler.step(optimizer)  # unscales internally -- too late for the clip above
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
