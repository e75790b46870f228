"""A prefetching loop (the next micro-batch is fetched before the backward, as nanoGPT does)
whose window condition counts from 0: `if micro_step % K == 0` steps after the first micro-batch,
so the first update holds one micro-batch and every later one straddles two windows."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    it = iter(micro_batches)
    x, y = next(it)
    micro_step = 0
    model.train()
    while x is not None:
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(x).float(), y) / K
        x, y = next(it, (None, None))
        scaler.scale(loss).backward()
        if micro_step % K == 0:
            scaler.step(optimizer)  # BUG: gradient-mismatch
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        micro_step += 1
