"""What the framework callbacks of `ampdoctor.watch` share (the HF Trainer's `WatchCallback`,
`watch_accelerate`): a `Watch` whose findings also go to the framework's log, that leaves torch
as it found it before an `on_error="raise"` stops a loop the framework runs, and that knows the
autocast accelerate wraps around a prepared model's forward. Nothing here imports a framework.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..core.findings import Finding
from . import Watch, WatchError
from .checks import Window
from .patching import direct_site
from .replay import Replayed


class FrameworkWatch(Watch):
    """A `Watch` for a run a framework drives (`framework` names it in the evidence, so a
    finding's fix is said in its terms)."""

    #: where a finding is said besides the Python warning (the framework's logger)
    log: Callable[[str], None] | None = None
    #: the precision of the autocast the framework enters inside the model's forward, where
    #: the forward pre-hook cannot see it (accelerate's prepared forward)
    autocast_precision: str | None = None

    def _found(self, finding: Finding) -> None:
        try:
            super()._found(finding)
        except WatchError as error:
            # no end-of-training event follows an exception out of the framework's loop
            self.__exit__(type(error), error, None)
            raise
        if self.log is not None and any(f is finding for f in self.findings):
            where = (f" at {finding.location.file}:{finding.location.line}"
                     if finding.location else "")
            self.log(f"ampdoctor watch: {finding.severity} {finding.kind}{where}: "
                     f"{finding.message}")

    #: the window whose scheduler line is one the user's code stepped itself
    _scheduler_direct: Window | None = None

    def _wrap_scheduler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """As the plain loop's, but the line a scheduler finding names is one where the
        user's code steps the scheduler itself (a `training_step` override, a loop of its
        own), not the framework's own step, which comes first in each window."""
        counted = super()._wrap_scheduler_step(original)
        watch = self

        def step(*args: Any, **kwargs: Any) -> Any:
            w = watch.window
            direct = None if watch._scheduler_direct is w else \
                direct_site(sys._getframe(1), watch.finder)
            result = counted(*args, **kwargs)
            if direct is not None:
                w.scheduler_site = watch.scheduler_site = direct
                watch._scheduler_direct = w
            return result
        return step

    def _reference(self, w: Window) -> Replayed | None:
        with _plain_forward(self.model):
            return super()._reference(w)

    def _on_forward(self, module: Any, args: Any) -> None:
        super()._on_forward(module, args)
        w = self.window
        if w.batches and w.precision == "fp32" and self.autocast_precision is not None:
            w.precision = self.autocast_precision


@contextlib.contextmanager
def _plain_forward(model: torch.nn.Module) -> Iterator[None]:
    """The model's own forward for the fp32 replay: accelerate's `prepare` replaces it by one
    that enters autocast inside (which the replay's `autocast(enabled=False)` around it
    cannot turn off) and keeps the plain one as `_original_forward`."""
    swapped = []
    for module in (model, getattr(model, "module", None)):
        if isinstance(module, torch.nn.Module) and "_original_forward" in vars(module) \
                and "forward" in vars(module):
            swapped.append((module, vars(module)["forward"]))
            module.forward = vars(module)["_original_forward"]
    try:
        yield
    finally:
        for module, forward in swapped:
            module.forward = forward


def accelerate_precision(accelerator: Any, model: Any) -> str | None:
    """bf16 / fp16 when accelerate wrapped the model's forward in its autocast
    (`Accelerator(mixed_precision=...)` where native AMP runs; `prepare` keeps the plain
    forward as `_original_forward`), else None."""
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    wrapped = getattr(model, "_original_forward", None) is not None or \
        getattr(getattr(model, "module", None), "_original_forward", None) is not None
    if mixed in ("bf16", "fp16") and getattr(accelerator, "native_amp", False) and wrapped:
        return mixed
    return None
