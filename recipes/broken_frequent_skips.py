"""The GradScaler was "tuned" to squeeze fp16: a huge initial scale that doubles after every
successful step (growth_interval=1). The scale never settles: it grows into overflow, backs
off, grows again, so a large fraction of optimizer steps are skipped (sawtooth get_scale())."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, init_scale=2.0 ** 24, growth_factor=2.0, backoff_factor=0.5, growth_interval=1, enabled=run.precision == "fp16")  # BUG: frequent-skips

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
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
