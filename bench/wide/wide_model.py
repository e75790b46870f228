"""A 22M-parameter residual MLP (LayerNorm + Linear 2048x2048 + GELU, five blocks) for the
memory benchmark: the recipes' tiny models say nothing about how a diagnose scales."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class WideMLP(nn.Module):
    def __init__(self, d_in: int = 512, width: int = 2048, depth: int = 5, n_classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
             for _ in range(depth)])
        self.out = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def make_model() -> nn.Module:
    return WideMLP()


def make_data(n: int = 1536):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 512, generator=g)
    return x, x[:, :10].argmax(1)


def ce_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.cross_entropy(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (i + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
