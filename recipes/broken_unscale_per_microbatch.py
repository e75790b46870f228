"""A per-micro-batch gradient-norm monitor unscales "to see real numbers" after every backward.
In fp16 the second micro-batch's unscale_() meets the first one still pending (no update() in
between) and torch refuses: RuntimeError: unscale_() has already been called on this optimizer
since the last update(). In fp32 and bf16 the scaler is disabled and nothing shows."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    norms = []

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # BUG: unscale-twice
        norms.append(float(torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])))

        if (step + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return norms
