"""The loop computes the scaled loss for a logging hook but backpropagates the plain loss:
`scaled = scaler.scale(loss)` then `loss.backward()`. The gradients never carry the scale,
yet `scaler.unscale_` divides them by it: every update is 1/S of what it should be (in fp16
with S = 65536 training barely moves), and small fp16 gradients underflow with no scale to
protect them."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    scaled_losses = []

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaled = scaler.scale(loss)
        scaled_losses.append(scaled.item())
        loss.backward()  # BUG: unscale-twice

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return scaled_losses
