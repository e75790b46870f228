"""The probe: one run of the user's loop, recorded as typed events (`events`).

ampdoctor observes the loop; it never rewrites it. The wrappers (`wrappers`) call the original
torch function and, while a probe is active, record an event carrying the user's call site and
the micro-batch the model last consumed. At every `optimizer.step()` (a global pre-hook) the
probe also records the gradients the step is about to consume and the parameters it sees
(`StepRecord`, `Snapshot`), the raw material of the teacher-forced comparison.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, TypeVar

import torch

from ..core import progress
from ..core.errors import EnoughSteps
from ..maths import shards
from ..maths.compare import all_finite, dense, same_tensors
from . import spill
from .callsite import CallSiteFinder, Site
from .events import (
    Backward,
    Event,
    Forward,
    MicroBatchFetched,
    OptimizerStep,
    Snapshot,
    StepRecord,
)
from .feed import ForwardAligner, MicroBatchFeed, MicroBatchIndex, storages
from .observer import ProbeSettings, StepObserver

E = TypeVar("E", bound=Event)

#: The probe currently recording, if any. Wrappers are inert while it is None.
ACTIVE: Probe | None = None

#: The settings of the run or reference in progress (`observing`); the defaults otherwise.
_SETTINGS = ProbeSettings()


@contextlib.contextmanager
def observing(settings: ProbeSettings) -> Iterator[ProbeSettings]:
    """Run ampdoctor's computation (a run of the loop, a reference) under `settings`; the
    previous ones are back on any exit."""
    global _SETTINGS
    previous, _SETTINGS = _SETTINGS, settings
    try:
        yield settings
    finally:
        _SETTINGS = previous


def current_settings() -> ProbeSettings:
    """The settings the patched torch functions follow now."""
    return _SETTINGS


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded parameter or gradient (FSDP2's DTensor) gathered whole; any other as it is.
    Gathering is a collective: every rank of a sharded run reaches it at the same step."""
    gather = getattr(t, "full_tensor", None)
    return gather() if callable(gather) else t


@dataclass
class Consumed:
    """What a step consumed when a framework's optimizer keeps it away from the model's own
    tensors (DeepSpeed's fp32 master copies and flat partitions): the gradients and the
    weights (a state dict: masters in place of the parameters), by the model's names, as fp32
    host tensors of their own."""

    grads: dict[str, torch.Tensor | None]
    weights: dict[str, torch.Tensor]


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class Probe:
    """Records one run of the user's loop."""

    def __init__(self, finder: CallSiteFinder, model: torch.nn.Module | None = None,
                 optimizers: list[torch.optim.Optimizer] | None = None):
        self.finder = finder
        #: where the user's code computed the last scalar loss inside a framework's training
        #: step (probe/frameworks.py): the site of a backward the framework itself calls
        self.loss_site: Site | None = None
        self.events: list[Event] = []
        self.steps: list[StepRecord] = []
        self.snapshots: dict[int, Snapshot] = {}
        self.current_microbatch = -1
        self.model = model
        self.param_names: dict[int, str] = {}
        if model is not None:
            self.param_names = {id(p): name for name, p in model.named_parameters()}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._aliases: dict[int, Any] = {}
        self._scalers: list[Any] = []
        for opt in optimizers or []:
            self.optimizer_slot(opt)
        self.backward_count = 0
        self._group = -1
        self._backwards_at_group = -1
        self._group_consumed: tuple[int, ...] = ()
        self.fetched = -1
        self._depth: dict[str, int] = {}
        #: recent get_total_norm calls: (the norm returned, its norm type, id() of the grads)
        self.total_norms: list[tuple[Any, float, set[int]]] = []
        self._scaler_step_slot: int | None = None
        self.optimizer_step_count = 0
        #: Micro-batches whose forward ran since the last step group began.
        self._consumed: list[int] = []
        #: A top-level forward was matched to a micro-batch: `current_microbatch` then follows
        #: what the model consumed, not what the loop fetched (a loop may fetch ahead).
        self.forward_matched = False
        self.aligner: ForwardAligner | None = None
        #: where the loop first drew random numbers outside the model's forward
        self.random_site: Site | None = None
        #: Called as inject(probe, loss_tensor) before each backward (overflow injection).
        self.before_backward: Callable[[Probe, torch.Tensor], None] | None = None
        self.capture_grads = True
        #: keep this rank's piece of a sharded gradient (FSDP2), not the whole gathered: the
        #: judge compares it with the same piece of the reference (`compare.metrics_of`)
        self.shard_wise = False
        #: Called with each StepRecord (gradients filled) as the step happens; the record then
        #: keeps no gradients and the probe no snapshots (a streamed comparison).
        self.step_sink: Callable[[StepRecord], None] | None = None
        #: Called with the names of the model's parameters that do not require a gradient as
        #: each step group begins (a loop may freeze part of the model it was handed): the
        #: reference then trains what the loop trains
        self.on_frozen: Callable[[frozenset[str]], None] | None = None
        #: Sees each step as it happens (`observer.StepObserver`, set by the rung driver), or
        #: None: the probe copies what every step consumed
        self.step_observer: StepObserver | None = None
        #: the weights the run started from, when they are the session's initial state: a
        #: first snapshot equal to them is kept as that same dict, not copied
        self.initial_state: Mapping[str, torch.Tensor] | None = None
        self._scaled_read = False
        #: each scaler's scale as last read, with the scale tensor it was read from: scale()
        #: runs every micro-batch and the scale only changes in update() (a read is a sync)
        self.scales_seen: dict[int, tuple[Any, float | None]] = {}
        #: how many scaled losses' graphs were walked for the leaves they reach, per scaler
        self.reach_walks: dict[int, int] = {}
        #: Takes an optimizer step over when a framework's engine is stepping (`deepspeed`):
        #: called with the optimizer at its step pre-hook, True when it records the step itself
        self.framework_step: Callable[[Any], bool] | None = None

    # --- bookkeeping --------------------------------------------------------------------
    def alias_optimizer(self, wrapper: Any, inner: Any) -> None:
        """`wrapper` (a framework's optimizer around `inner`) is `inner`'s slot: what the
        loop or a scheduler does to either is done to the optimizer that steps."""
        self._aliases[id(wrapper)] = inner

    def optimizer_slot(self, optimizer: Any) -> int:
        optimizer = self._aliases.get(id(optimizer), optimizer)
        for slot, known in enumerate(self._optimizers):
            if known is optimizer:
                return slot
        self._optimizers.append(optimizer)
        return len(self._optimizers) - 1

    def scaler_slot(self, scaler: Any) -> int:
        for slot, known in enumerate(self._scalers):
            if known is scaler:
                return slot
        self._scalers.append(scaler)
        return len(self._scalers) - 1

    def enabled_scalers(self) -> int:
        """How many of the run's GradScalers are enabled."""
        return sum(1 for s in self._scalers if s.is_enabled())

    @property
    def optimizers(self) -> list[Any]:
        return list(self._optimizers)

    @property
    def scalers(self) -> list[Any]:
        return list(self._scalers)

    def param_name(self, param: torch.Tensor, slot: int, index: int) -> str:
        return self.param_names.get(id(param), f"optimizer{slot}.param{index}")

    def record(self, event_type: type[E], site: Site | None = None, **fields: Any) -> E:
        """Append an event of `event_type`; the call site defaults to the wrapper's caller."""
        event = event_type(seq=len(self.events), microbatch=self.current_microbatch,
                           backwards=self.backward_count,
                           site=site if site is not None else self.finder.from_frame(_caller(3)),
                           **fields)
        self.events.append(event)
        return event

    def complete(self, event: E, **fields: Any) -> E:
        """Replace a recorded event by a copy with what was learned once torch returned."""
        done = replace(event, **fields)
        self.events[event.seq] = done
        return done

    def enter(self, name: str) -> int:
        self._depth[name] = self._depth.get(name, 0) + 1
        return self._depth[name]

    def leave(self, name: str) -> None:
        self._depth[name] -= 1

    def inside(self, name: str) -> bool:
        return self._depth.get(name, 0) > 0

    # --- events -------------------------------------------------------------------------
    def on_microbatch(self, index: int) -> None:
        if not self.forward_matched:
            self.current_microbatch = index
        self.fetched = index
        self.record(MicroBatchFetched, index=index)

    def on_forward(self, index: int | None) -> None:
        if index is not None:
            self.forward_matched = True
            self.current_microbatch = index
            self._consumed.append(index)
        self.record(Forward, index=index)

    def on_backward(self, tensor: torch.Tensor, site: Site | None) -> None:
        scaled_by = getattr(tensor, "_ampdoctor_scale", None)
        # Reading the loss is a host-device sync on a GPU: only the run's first backward and
        # its first scaled one are read (what `rules.scale_state` compares), not every one.
        read = tensor.numel() == 1 and (self.backward_count == 0
                                        or (scaled_by is not None and not self._scaled_read))
        value = float(tensor.detach().float()) if read else None
        self._scaled_read = self._scaled_read or (read and scaled_by is not None)
        self.backward_count += 1
        self.record(Backward, site=site, value=value, scaled_by=scaled_by,
                    lrs=tuple(_first_lr(o) for o in self._optimizers))

    def _snapshot(self, state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Keep the weights the current step group starts from (the reference's parameters):
        the model's, or `state` where a framework keeps them (its fp32 masters)."""
        model = self.model
        assert model is not None   # (a probe without a model keeps no snapshots)
        state = model.state_dict() if state is None else state
        kept: Mapping[str, torch.Tensor]
        if (not self.snapshots and self.initial_state is not None
                and same_tensors(state, self.initial_state)):
            kept = self.initial_state   # the first step saw the initial weights: no copy
        else:
            kept = spill.maybe_spill({k: full_tensor(v.detach()).to("cpu", copy=True)
                                      for k, v in state.items()})
        self.snapshots[self._group] = Snapshot(self._group, kept, model.training)

    def _begin_group_if_new(self, state: Mapping[str, torch.Tensor] | None = None) -> None:
        """At the first step since new gradients were computed, start a step group: snapshot the
        parameters all of this group's steps were computed at (a second optimizer's pre-hook
        would otherwise see the first one's update), unless the step observer takes it."""
        if self.backward_count == self._backwards_at_group:
            return
        self._group += 1
        self._backwards_at_group = self.backward_count
        self._group_consumed = tuple(sorted(set(self._consumed)))
        self._consumed = []
        if self.model is not None and self.on_frozen is not None:
            self.on_frozen(frozenset(n for n, p in self.model.named_parameters()
                                     if not p.requires_grad))
        if self.model is not None and self.capture_grads and self.step_sink is None:
            observer = self.step_observer
            if observer is None or not observer.begin_group(
                    self._group, self._group_consumed,
                    self.model.state_dict() if state is None else state,
                    self.model.training):
                self._snapshot(state)

    def _gradients(self, optimizer: torch.optim.Optimizer, slot: int,
                   live: bool) -> tuple[dict[str, torch.Tensor | None], bool]:
        """The gradients a step is about to consume, by parameter name (live tensors for an
        observed step, host copies when captured, none otherwise), and whether all are
        finite."""
        grads: dict[str, torch.Tensor | None] = {}
        finite = True
        for index, param in enumerate(optimizer_params(optimizer)):
            if param.grad is None:
                if self.capture_grads:
                    grads[self.param_name(param, slot, index)] = None
                continue
            grad = dense(param.grad)
            if live:   # seen as it happens: copied only if the observer asks
                grads[self.param_name(param, slot, index)] = grad.detach()
            elif self.capture_grads:
                grads[self.param_name(param, slot, index)] = _host_copy(grad, self.shard_wise)
            elif finite:
                finite = all_finite(grad)
        if self.capture_grads:
            finite = all(g is None or all_finite(g) for g in grads.values())
        return grads, finite

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer,
                          consumed: Consumed | None = None) -> None:
        slot = self.optimizer_slot(optimizer)
        self._begin_group_if_new(consumed.weights if consumed is not None else None)
        observer = self.step_observer
        live = observer is not None and observer.observes(self._group)
        if consumed is not None:
            grads = consumed.grads
            finite = all(g is None or all_finite(g) for g in grads.values())
        else:
            grads, finite = self._gradients(optimizer, slot, live)
        lrs = tuple(float(g["lr"]) for g in optimizer.param_groups
                    if isinstance(g.get("lr"), (int, float, torch.Tensor)))
        site = self.finder.from_frame(_caller(2))
        record = StepRecord(len(self.events), slot, self.current_microbatch,
                            self.backward_count, self._group, grads, site,
                            self._scaler_step_slot, self._group_consumed, lrs, finite)
        enough = False
        if self.step_sink is not None:
            enough = bool(self.step_sink(record))   # true: the run has given what it was for
            record.grads = {}
        elif live and observer is not None:
            keep = observer.on_step(record)
            if keep.state:
                self._snapshot(consumed.weights if consumed is not None else None)
            if keep.names is not None:
                record.grads = keep.names
            else:
                record.grads = spill.maybe_spill(
                    {n: None if g is None else _host_copy(g, self.shard_wise)
                     for n, g in grads.items()})
                observer.copied(record)
        elif self.capture_grads:
            record.grads = spill.maybe_spill(grads)
        self.steps.append(record)
        self.optimizer_step_count += 1
        if slot == 0:
            progress.optimizer_stepped()
        self.record(OptimizerStep, site=site, optimizer=slot,
                    via_scaler=self._scaler_step_slot is not None)
        if enough:
            raise EnoughSteps


def _host_copy(grad: torch.Tensor, shard_wise: bool = False) -> torch.Tensor:
    """A gradient as an fp32 host tensor of its own: when sharded (FSDP2's DTensor), this
    rank's piece of it (`shard_wise`, marked with where it lies: `shards.piece`) or the whole,
    gathered."""
    if shard_wise and shards.is_sharded(grad):
        return shards.piece(grad.detach(),
                            lambda local: local.to("cpu", torch.float32, copy=True))
    return full_tensor(grad.detach()).to("cpu", torch.float32, copy=True)


class Shared:
    """A callback the probe holds that reaches the session (`Probe.on_frozen`): a loop that
    deep-copies its model (an EMA) copies the probe its hooks reach, and must not copy the
    session behind it (as `StepJudge.__deepcopy__`)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Shared:
        return self


def _first_lr(optimizer: Any) -> float | None:
    """Parameter group 0's learning rate as a number, without a device sync (None when it is
    a tensor or missing)."""
    groups = getattr(optimizer, "param_groups", None) or [{}]
    lr = groups[0].get("lr") if isinstance(groups[0], dict) else None
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def _caller(depth: int) -> FrameType:
    return sys._getframe(depth)


def activate(probe: Probe | None) -> Probe | None:
    """Make `probe` the recording one; return the previous."""
    global ACTIVE
    previous, ACTIVE = ACTIVE, probe
    return previous


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


__all__ = ["Consumed", "Event", "StepRecord", "Snapshot", "Probe", "MicroBatchFeed",
           "MicroBatchIndex", "ForwardAligner", "storages", "activate", "finite", "ACTIVE",
           "ProbeSettings", "StepObserver", "observing", "current_settings"]
