"""Healthy, written the way YOLOv5's train.py accumulates: `accumulate = max(round(nbs / bs), 1)`
with the loss scaled by the batch size and divided by the nominal batch size, a step whenever
`ni - last_opt_step >= accumulate`, clipping at a fixed max_norm=10.0 after unscale_, and an EMA
copy of the model updated after every optimizer step. The model (common: none -- defined here)
recomputes its first block with activation checkpointing and has LayerNorm and dropout. In fp16
the default GradScaler overflows once at step 1 and backs off: one skip, not a frequent one."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class CheckpointedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.drop = nn.Dropout(0.2)
        self.b = nn.Linear(32, 1)

    def block(self, x):
        return torch.tanh(self.norm(self.a(x)))

    def forward(self, x):
        return self.b(self.drop(checkpoint(self.block, x, use_reentrant=False)))


def make_model():
    return CheckpointedNet()


def make_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 16, generator=g)
    return x, x[:, :1] * 2 + 0.1 * torch.randn(96, 1, generator=g)


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def train_loop(model, optimizer, micro_batches, run):
    nbs, batch_size = 32, 8                        # nominal batch size, batch size
    accumulate = max(round(nbs / batch_size), 1)   # accumulate loss before optimizing
    amp = run.autocast_dtype is not None
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    ema = copy.deepcopy(model).eval()
    last_opt_step = -1
    optimizer.zero_grad()
    for i, (imgs, targets) in enumerate(micro_batches):
        ni = i  # number integrated batches (since train start)
        with torch.autocast(run.device_type, dtype=run.autocast_dtype or torch.float32,
                            enabled=amp):
            pred = model(imgs)
            loss = F.mse_loss(pred.float(), targets) * batch_size  # loss scaled by batch_size
        scaler.scale(loss / nbs).backward()
        if ni - last_opt_step >= accumulate:
            scaler.unscale_(optimizer)  # unscale gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)  # clip gradients
            scaler.step(optimizer)  # optimizer.step
            scaler.update()
            optimizer.zero_grad()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.mul_(0.999).add_(p, alpha=0.001)
            last_opt_step = ni
