"""Shared model and data helpers, imported by both entry points."""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))


def toy_dataset(n: int = 256) -> TensorDataset:
    return TensorDataset(torch.randn(n, 16), torch.randint(0, 2, (n,)))
