"""A run of the script as its child process reported it (`child.Outcome`), replayed as the
`Trace` the judge and the rules read (`ScriptTrace`): its events, step records and weights, the
exception it raised rebuilt from its type and text, stand-ins for its optimizers and scalers
(which lived in the child)."""

from __future__ import annotations

import bisect
import builtins
from dataclasses import dataclass, field
from typing import Any

import torch

from ..loading import AUTOCAST_DTYPES, RunSettings
from ..probe import recorder
from ..probe.callsite import CallSiteFinder
from ..probe.events import Backward, ScalerInit, ScalerStep, StepRecord
from ..probe.trace import Trace
from .child import Outcome


class ScriptRaised(Exception):
    """The script raised an exception that did not come back as itself (only its type name and
    text did)."""


def rebuilt_error(error: dict[str, Any]) -> BaseException:
    """The script's exception from its type name and text: a builtin type as itself (torch's
    refusals are RuntimeError / AssertionError), anything else as ScriptRaised."""
    cls = getattr(builtins, str(error.get("type")), None)
    message = str(error.get("message") or "")
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 - a builtin with another signature
            pass
    if error.get("type") == "SystemExit":
        return SystemExit(message)
    return ScriptRaised(f"{error.get('type')}: {message}")


class _Slot:
    """Stands for an optimizer of a run that lived in its child process."""

    param_groups: list[dict[str, Any]] = []


class _ScalerSlot:
    """Stands for a GradScaler of a run that lived in its child process (`ScalerInit`)."""

    def __init__(self, init: ScalerInit):
        self.init = init

    def is_enabled(self) -> bool:
        return bool(self.init.enabled)

    def get_backoff_factor(self) -> float:
        return float(self.init.backoff_factor or 0.5)


@dataclass
class ScriptTrace(Trace):
    """A run of the script, as its child process reported it."""

    outcome: Outcome = field(default_factory=Outcome)
    _backward_order: dict[int, int] | None = None
    #: where each of the reference's windows ends in this run's micro-batches (exclusive, in
    #: order), once the fp32 reference has run: an epoch's short last window makes the windows
    #: differ from `i // K` for every micro-batch after it (`ScriptSession.window_bounds`)
    bounds: tuple[int, ...] | None = None

    def window_of_event(self, event: recorder.Event | StepRecord) -> int | None:
        """By the reference's windows when known (past the last one: K micro-batches each),
        else as a spec's trace counts them."""
        if not self.bounds:
            return super().window_of_event(event)
        mb = (max(event.consumed) if isinstance(event, StepRecord) and event.consumed
              else event.microbatch)
        if mb < 0:
            return 0
        last = self.bounds[-1]
        if mb < last:
            return bisect.bisect_right(self.bounds, mb)
        return len(self.bounds) + (mb - last) // max(self.accumulation_steps, 1)

    def window_size(self, window: int) -> int | None:
        """The micro-batches of one of the reference's windows, when known."""
        if not self.bounds or not 0 <= window < len(self.bounds):
            return None
        return self.bounds[window] - (self.bounds[window - 1] if window else 0)

    def unstepped_window(self, before: int | None, window: int | None) -> int | None:
        if before is None or window is None or window <= before + 1:
            return None
        size = self.window_size(before + 1)
        if size is None or size >= self.accumulation_steps:
            return None
        # a scaler.step there that skipped the optimizer (an overflow) is no unstepped window
        if any(self.window_of_event(e) == before + 1 for e in self.events_of(ScalerStep)):
            return None
        return before + 1

    def parameter_names(self) -> dict[int, str]:
        return dict(self.outcome.param_names)

    def parameter_owners(self) -> dict[int, int]:
        return dict(self.outcome.owners)

    @property
    def model(self) -> torch.nn.Module | None:
        return None

    def backward_optimizers(self, event: Backward) -> set[int] | None:
        """The optimizer slots whose parameters `event` gave gradients (None: unknown)."""
        if not self.outcome.backward_slots:
            return None
        if self._backward_order is None:
            self._backward_order = {e.seq: n for n, e in enumerate(
                (e for e in self.probe.events if isinstance(e, Backward)), start=1)}
        n = self._backward_order.get(event.seq)
        return self.outcome.backward_slots.get(n, set()) if n is not None else None


def replay(outcome: Outcome, precision: str, K: int, finder: CallSiteFinder,
           max_grad_norm: float | None) -> ScriptTrace:
    """The Trace of a child run (its events, steps and weights as the probe recorded them)."""
    probe = recorder.Probe(finder)
    probe.events = list(outcome.events)
    probe.steps = list(outcome.steps)
    probe.snapshots = dict(outcome.snapshots)
    probe.backward_count = outcome.backward_count
    probe.forward_matched = bool(outcome.forwards)
    probe.random_site = outcome.random_site
    slots = max([len(outcome.optimizers)] + [s.optimizer + 1 for s in outcome.steps])
    for _ in range(slots):
        probe.optimizer_slot(_Slot())
    for init in outcome.events:
        if isinstance(init, ScalerInit):
            probe.scaler_slot(_ScalerSlot(init))
    device = torch.device(outcome.device)
    settings = RunSettings(precision=precision, device=device, device_type=device.type,
                           autocast_dtype=AUTOCAST_DTYPES[precision], accumulation_steps=K,
                           max_grad_norm=max_grad_norm,
                           micro_batch_size=outcome.forwards[0].rows if outcome.forwards
                           else None,
                           optimizer_steps=len({s.group for s in outcome.steps}) or 1)
    error = rebuilt_error(outcome.error) if outcome.error is not None else None
    return ScriptTrace(precision, K, probe, settings, error=error,
                       error_site=outcome.error.get("site") if outcome.error else None,
                       optimizer_count=slots, microbatches=len(outcome.forwards),
                       stopped=outcome.ended == "stopped", cast=outcome.cast, outcome=outcome)
