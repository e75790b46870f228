"""A grad-norm logging helper calls scaler.unscale_() itself "to log the true norm"; the loop
then calls scaler.unscale_() again before clipping. torch refuses the second call in fp16:
RuntimeError: unscale_() has already been called on this optimizer since the last update()."""

import torch
import torch.nn as nn


def log_grad_norm(model, optimizer, scaler, history):
    scaler.unscale_(optimizer)
    norms = [p.grad.detach().norm(2) for p in model.parameters() if p.grad is not None]
    history.append(float(torch.norm(torch.stack(norms), 2)))


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    grad_norm_history = []

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
            log_grad_norm(model, optimizer, scaler, grad_norm_history)
            scaler.unscale_(optimizer)  # BUG: unscale-twice
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return grad_norm_history
