"""Healthy: backbone and head have separate optimizers (spec optimizer:
common:make_two_optimizers). Every optimizer goes through the same scaler path:
unscale_ each -> clip over all parameters -> scaler.step each -> one update() -> zero each."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            out = model(x)
            loss = criterion(out.float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            for opt in optimizers:
                scaler.unscale_(opt)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            for opt in optimizers:
                scaler.step(opt)
            scaler.update()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
