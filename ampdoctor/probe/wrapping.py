"""What every wrapper around torch needs (`wrappers`, `scaler_wrappers`): the active probe,
the frame of the code that called the wrapped function, and the norm of gradients."""

from __future__ import annotations

import sys
from types import FrameType

import torch

from ..maths.compare import dense
from . import recorder
from .recorder import Probe


def active() -> Probe | None:
    """The probe of the run in progress, or None (every wrapper is then inert)."""
    return recorder.ACTIVE


def caller(depth: int) -> FrameType:
    """The frame `depth` levels up from the call of `caller`: 2, from inside a wrapper, is the
    code that called the wrapped function."""
    return sys._getframe(depth)


def grad_norm(params: list[torch.Tensor]) -> float:
    """The global L2 norm of the gradients the parameters hold (0.0 when none has one)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    with torch.no_grad():
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(dense(g.detach()).float()) for g in grads]))
    return float(total)
