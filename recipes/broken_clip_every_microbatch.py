"""Broken: the gradient is clipped after every backward, not once per window (the clip sits
outside the accumulation-boundary `if`, as accelerate's `clip_grad_norm_` does outside the
`sync_gradients` gate). Each clip that bites shrinks a partial sum of the window, so the update
is off in size and direction. Under fp16 the partial sums are still scaled; here the loop
unscales nothing before its early clips, so the fp32 rung already shows it. Twin:
healthy_clip_active.py."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    model.train()
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)  # BUG: gradient-mismatch
        if (step + 1) % K == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
