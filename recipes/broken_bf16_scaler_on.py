"""Half-open AMP: the scaler is enabled for "any mixed precision", so it also runs in bf16,
where there is nothing to protect against (bf16 has fp32's exponent range). It multiplies
bf16 gradients by 65536, scans them for infs and may skip steps for no reason; the loss-scale
state machine belongs to fp16 only."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    mixed_precision = run.precision != "fp32"
    scaler = torch.amp.GradScaler(run.device_type, enabled=mixed_precision)  # BUG: half-open-amp

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=mixed_precision):
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
