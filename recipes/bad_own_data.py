"""A train_loop that ignores the `micro_batches` it is given and builds its own data (exit 3)."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
    for i in range(0, 32, 8):
        loss = nn.functional.mse_loss(model(x[i:i + 8]), y[i:i + 8]) / 4
        loss.backward()  # BUG: loop-error
    optimizer.step()
    optimizer.zero_grad()
