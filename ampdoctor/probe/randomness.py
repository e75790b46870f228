"""Randomness during the triage: `dropout: off` (functional dropout at p = 0, so
`model.train()` cannot undo it) and the call site of the first random draw outside the model's
forward (randomness `dropout: align` cannot give every run the same state)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from . import recorder
from .patches import Patcher

_DROPOUT_FUNCTIONS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                      "feature_alpha_dropout")


def _wrap_dropout(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dropout(input: Any, p: float = 0.5, *args: Any, **kwargs: Any) -> Any:
        if recorder.current_settings().dropout_off:
            p = 0.0
            kwargs.pop("p", None)
        return original(input, p, *args, **kwargs)
    return dropout


def _wrap_sdpa(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        if recorder.current_settings().dropout_off:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        return original(*args, **kwargs)
    return scaled_dot_product_attention


#: Random draws outside the model's forward cannot be aligned per micro-batch: the first one's
#: call site is where a non-repeatable baseline comes from.
_RANDOM_FUNCTIONS = ("rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
                     "randperm", "normal", "bernoulli", "multinomial", "poisson")


def _wrap_random(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def draw(*args: Any, **kwargs: Any) -> Any:
        probe = recorder.ACTIVE
        if probe is not None and not probe.inside("random") and (
                probe.aligner is None or probe.aligner.depth == 0) and probe.random_site is None:
            probe.random_site = probe.finder.from_frame(sys._getframe(1))
        if probe is None:
            return original(*args, **kwargs)
        probe.enter("random")
        try:
            return original(*args, **kwargs)
        finally:
            probe.leave("random")
    return draw


def install(patcher: Patcher) -> None:
    import torch

    for name in _RANDOM_FUNCTIONS:
        if hasattr(torch, name):
            patcher.setattr(torch, name, _wrap_random(getattr(torch, name), name))
    functional = torch.nn.functional
    for name in _DROPOUT_FUNCTIONS:
        if hasattr(functional, name):
            patcher.setattr(functional, name, _wrap_dropout(getattr(functional, name)))
    patcher.setattr(functional, "scaled_dot_product_attention",
                    _wrap_sdpa(functional.scaled_dot_product_attention))
