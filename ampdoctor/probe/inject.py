"""The skips rung's overflow injection: one inf written into one parameter's gradient during
one micro-batch's backward (a one-shot tensor hook; the user's code is untouched). A module of
the probe layer, so that a run of a script (in its own child process) loads it without the
ladder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .events import Backward, MicroBatchFetched
from .recorder import Probe


class OverflowInjector:
    """From one backward of window `window` on, make the first parameter gradient that backward
    computes an inf (one element), once.

    The backward is found by the micro-batch handed out when the loop takes them as it goes
    (micro-batch `window*K + K//2`, or the window's later single backward when the loop sums
    its losses first), else by backward ordinal, from the plain run's backwards per window.
    Every trainable parameter is hooked, so a backward restricted with `inputs=` or a parameter
    that gets no gradient (an unused embedding) cannot swallow the inf; `fired` is true only
    once an inf was really written. Hooks still unused when the window is over are removed.
    """

    def __init__(self, window: int, K: int, backwards_per_window: int):
        self.window = window
        self.K = K
        self.target = window * K + K // 2
        self.target_backward = window * backwards_per_window + backwards_per_window // 2 + 1
        self.last_backward = (window + 1) * backwards_per_window
        self.fired = False
        self._handles: list[Any] = []
        self.param_id: int | None = None
        self.param_name: str | None = None

    def _remove(self) -> None:   # outside backward, never while it runs
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __call__(self, probe: Probe, loss: torch.Tensor) -> None:
        if self.fired:
            self._remove()
            return
        if probe.model is None:
            return
        first = next((e for e in probe.events if isinstance(e, Backward)), None)
        lazy = first is not None and any(isinstance(e, MicroBatchFetched) and e.seq > first.seq
                                         for e in probe.events)
        mb = probe.current_microbatch
        if lazy:
            in_window, reached = mb // self.K == self.window, mb >= self.target
        else:   # backward_count includes this backward
            in_window = probe.backward_count <= self.last_backward
            reached = probe.backward_count >= self.target_backward
        if not in_window:
            self._remove()
            return
        if not reached or self._handles:
            return
        for name, param in probe.model.named_parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(self._poison(name, param)))

    def _poison(self, name: str, param: torch.Tensor
                ) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def poison(grad: torch.Tensor) -> torch.Tensor | None:
            if self.fired:
                return None
            self.fired = True
            self.param_name = name
            self.param_id = id(param)
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad
        return poison
