"""Ported from apex-era code that unscaled by hand: the manual division survived the switch to
torch.amp, and now follows scaler.unscale_(). In fp16 the gradients are divided by the loss
scale twice, so the update is ~1/65536 of what it should be (fp32/bf16 are unaffected because
a disabled scaler reports get_scale() == 1.0)."""

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
            scaler.unscale_(optimizer)
            # undo the loss scale before clipping / stepping
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(scaler.get_scale())  # BUG: unscale-twice
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
