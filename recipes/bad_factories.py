"""Factories that fail, for the sample_configs/bad/ specs (exit code 3 cases)."""

import torch

from common import make_regression_data


def make_model_raises():
    hidden = {"small": 32, "large": 128}
    size = "medium"
    if size not in hidden:
        raise ValueError(f"unknown model size {size!r}; expected one of {sorted(hidden)}")
    return torch.nn.Linear(16, hidden[size])


def make_nan_data():
    """The regression slice with one corrupted sample: x[5, 3] is NaN (a bad CSV cell)."""
    x, y = make_regression_data()
    x = x.clone()
    x[5, 3] = float("nan")
    return x, y


def make_frozen_model():
    """A model whose every parameter was frozen (a fine-tuning script that forgot to unfreeze
    the head): nothing for an optimizer to update."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    for param in model.parameters():
        param.requires_grad_(False)
    return model
