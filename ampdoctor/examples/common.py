"""The model, data and loss the examples share: a 16 -> 32 -> 1 MLP, a deterministic regression
slice (96 samples: 3 optimizer steps x K=4 micro-batches x b=8), and the mean MSE of one
micro-batch (the loss ampdoctor's fp32 reference uses)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES = 16
HIDDEN = 32
DATA_SEED = 1234
SAMPLES = 96


def make_mlp() -> nn.Module:
    """A 16 -> 32 -> 1 MLP with a Tanh; no dropout, no batch norm: fully deterministic."""
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def make_regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """`(x, y)`: x is 96 x 16, y is 96 x 1, from a private generator (never the global RNG)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(SAMPLES, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, 1, generator=g) / IN_FEATURES ** 0.5
    noise = 0.05 * torch.randn(SAMPLES, 1, generator=g)
    # targets of magnitude ~0.5 keep fp16 gradients well below overflow at the default scale
    y = 0.5 * torch.sin(2.0 * (x @ w)) + 0.25 * x[:, :1] + noise
    return x, y


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of one `(x, y)` micro-batch: a scalar, the micro-batch mean."""
    x, y = batch
    return F.mse_loss(model(x).float(), y.float())
