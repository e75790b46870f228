"""`ampdoctor.watch_accelerate`: the sentinel around a loop that HF accelerate drives.

    w = ampdoctor.watch_accelerate(accelerator, model, optimizer, scheduler=scheduler,
                                   loss_fn=loss_fn)
    with w:
        for batch in w.batches(train_dataloader):
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                ...

It reads from the prepared objects what the plain loop's `watch` is told: K from
`accelerator.gradient_accumulation_steps` (`accelerator.backward` divides by it), the torch
optimizer inside accelerate's `AcceleratedOptimizer` (whose `step` and `zero_grad` pass only
on the window's last micro-batch), the scheduler inside `AcceleratedScheduler` (which steps it
once per real update), the scaler `accelerator.scaler` (fp16), and the autocast `prepare` put
around the model's forward. Importing this module does not import accelerate.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..probe.callsite import CallSiteFinder
from . import DEFAULT_EVERY
from .checks import LossFn, built_at
from .frameworks import FrameworkWatch, accelerate_precision


def _inner(obj: Any, attribute: str, wrapper: str) -> Any:
    """The torch object inside accelerate's wrapper class `wrapper` (by name: accelerate
    need not be imported to tell)."""
    while obj is not None and any(c.__name__ == wrapper for c in type(obj).__mro__):
        obj = getattr(obj, attribute)
    return obj


def watch_accelerate(accelerator: Any, model: Any, optimizer: Any, *, scheduler: Any = None,
                     loss_fn: LossFn | None = None, every: int = DEFAULT_EVERY,
                     on_error: str = "warn", out: str | Path | None = None,
                     name: str = "accelerate run") -> FrameworkWatch:
    """The sentinel of an accelerate loop (module docstring, docs/watch.md): `model`,
    `optimizer` and `scheduler` as `accelerator.prepare` returned them; `loss_fn(model, batch)`
    the loss of one micro-batch before `accelerator.backward` divides it (a scalar mean, or a
    `(loss_sum, n_items)` pair for a token-weighted loss)."""
    steps = getattr(accelerator, "gradient_accumulation_steps", None)
    if not isinstance(steps, int):
        raise TypeError("watch_accelerate: the first argument must be the `Accelerator` that "
                        f"prepared the model, not {type(accelerator).__name__}")
    scaler = getattr(accelerator, "scaler", None)
    watch = FrameworkWatch(model, _inner(optimizer, "optimizer", "AcceleratedOptimizer"),
                           accumulation_steps=steps, scaler=scaler,
                           scheduler=_inner(scheduler, "scheduler", "AcceleratedScheduler"),
                           loss_fn=loss_fn, every=every, on_error=on_error, out=out, name=name)
    watch.framework = "accelerate"
    watch.autocast_precision = accelerate_precision(accelerator, model)
    if watch.scaler is not None:
        # accelerate builds the GradScaler: the line to name is the one that asked for fp16
        watch.scaler_site = built_at(accelerator, sys._getframe(1), CallSiteFinder())
    return watch
