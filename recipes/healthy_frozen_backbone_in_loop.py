"""Healthy: a fine-tuning loop that freezes the backbone itself (linear probing before full
fine-tuning: `model.backbone.requires_grad_(False)` for the first epochs), on the model it was
handed, and clips over `model.parameters()` (the frozen ones have no gradient, so torch's norm
leaves them out). The reference trains what the loop trains: judged against a reference that
still trained the backbone, every step would look like a gradient mismatch."""

import torch
import torch.nn as nn

PROBE_EPOCHS = 1


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    epoch = 0
    model.backbone.requires_grad_(epoch >= PROBE_EPOCHS)
    model.train()
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
