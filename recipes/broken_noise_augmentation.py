"""Gaussian input-noise augmentation drawn inside the training loop (a common regulariser for
regression and speech models). The loop is otherwise the textbook one, but the noise is drawn
outside the model's forward, so no two runs see the same inputs: the fp32 baseline is not
repeatable and no later comparison means anything. ampdoctor aligns randomness inside the
model's forward (dropout); this draw it cannot align."""

import torch
import torch.nn as nn

NOISE_STD = 0.1


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (x, y) in enumerate(micro_batches):
        x = x + NOISE_STD * torch.randn_like(x)  # BUG: nondeterministic-baseline
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
