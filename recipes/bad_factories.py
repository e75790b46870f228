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
