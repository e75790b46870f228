"""What the probe observes: one frozen dataclass per event, each with the user's call site.

Events are facts, never judgments. Every event carries its position in the run (`seq`), the
micro-batch the model last consumed (`microbatch`: the last forward matched to a micro-batch,
or the last one fetched when no forward could be matched), the number of backward calls so far
and the call site. Code selects events by their class (`of_type`, `Trace.events_of`, the state
machine's handlers); `kind` is a class attribute naming the event type in records and messages
(and `make_event`). An event whose outcome is known only after
torch's call returns (the norm after `unscale_`, whether `scaler.step` skipped) is replaced in
the probe's list by a completed copy (`Probe.complete`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from .callsite import Site


@dataclass(frozen=True)
class Event:
    seq: int
    microbatch: int
    backwards: int
    site: Site | None
    kind: ClassVar[str] = "event"


@dataclass(frozen=True)
class MicroBatchFetched(Event):
    """The loop took micro-batch `index` from `micro_batches`."""

    index: int = -1
    kind: ClassVar[str] = "microbatch"


@dataclass(frozen=True)
class Forward(Event):
    """A top-level forward of the model; `index` is the micro-batch it read (None: unmatched)."""

    index: int | None = None
    kind: ClassVar[str] = "forward"


@dataclass(frozen=True)
class Backward(Event):
    #: the loss reaching backward, when it is a scalar: read for the run's first backward and
    #: its first scaled one only (a read is a host-device sync)
    value: float | None = None
    scaled_by: float | None = None      # the GradScaler scale(s) applied to it
    #: parameter group 0's learning rate of each optimizer known so far (by slot) as the
    #: backward ran (None where it is a tensor: reading one would be a host-device sync)
    lrs: tuple[float | None, ...] = ()
    kind: ClassVar[str] = "backward"


@dataclass(frozen=True)
class ScalerInit(Event):
    scaler: int = 0
    enabled: bool = False
    init_scale: float | None = None
    growth_interval: int | None = None
    backoff_factor: float | None = None
    growth_factor: float | None = None
    kind: ClassVar[str] = "scaler_init"


@dataclass(frozen=True)
class Scale(Event):
    scaler: int = 0
    scale: float | None = None
    enabled: bool = False
    input_already_scaled: float | None = None   # scaler.scale() of an already scaled loss
    #: id() of each leaf tensor (parameter) the scaled loss's backward reaches, read from its
    #: autograd graph while two enabled GradScalers exist (None: not read)
    reaches: tuple[int, ...] | None = None
    kind: ClassVar[str] = "scale"


@dataclass(frozen=True)
class GetScale(Event):
    scaler: int = 0
    scale: float | None = None
    kind: ClassVar[str] = "get_scale"


@dataclass(frozen=True)
class Unscale(Event):
    scaler: int = 0
    optimizer: int | None = None
    scale: float | None = None
    enabled: bool = False
    inside_step: bool = False           # the unscale_ scaler.step does for you
    norm_before: float | None = None
    norm_after: float | None = None
    error: str | None = None            # torch refused it
    kind: ClassVar[str] = "unscale"


@dataclass(frozen=True)
class ScalerStep(Event):
    scaler: int = 0
    optimizer: int | None = None
    scale: float | None = None
    enabled: bool = False
    skipped: bool = False
    kind: ClassVar[str] = "scaler_step"


@dataclass(frozen=True)
class OptimizerStep(Event):
    optimizer: int | None = None
    via_scaler: bool = False
    kind: ClassVar[str] = "step"


@dataclass(frozen=True)
class Update(Event):
    scaler: int = 0
    scale_before: float | None = None
    scale_after: float | None = None
    error: str | None = None
    kind: ClassVar[str] = "update"


@dataclass(frozen=True)
class ZeroGrad(Event):
    optimizer: int | None = None
    owner: str = "optimizer"            # "optimizer" or "module" (model.zero_grad)
    kind: ClassVar[str] = "zero_grad"


@dataclass(frozen=True)
class Clip(Event):
    # "norm" (clip_grad_norm_, or clip_grads_with_norm_ after get_total_norm) or "value"
    # (clip_grad_value_)
    clip_kind: str = "norm"
    max_norm: float | None = None
    norm_type: float | None = None
    param_ids: tuple[int, ...] = ()
    total_norm: float | None = None     # what clip_grad_norm_ returned / clip_grads_with_norm_ got
    kind: ClassVar[str] = "clip"


@dataclass(frozen=True)
class SchedulerStep(Event):
    optimizer: int | None = None
    scheduler_type: str = ""
    scheduler: int = 0                  # id() of the scheduler object
    lr: float | None = None             # group 0's learning rate after the step
    lr_before: float | None = None
    last_epoch: int | None = None
    kind: ClassVar[str] = "scheduler"


@dataclass(frozen=True)
class AutocastEntered(Event):
    device_type: str | None = None
    enabled: bool | None = None
    dtype: str | None = None
    created_at: Site | None = None      # where the autocast object was built
    kind: ClassVar[str] = "autocast"


@dataclass(frozen=True)
class FrameworkPrecision(Event):
    """A training framework (accelerate, Lightning, Fabric) was asked for a precision and chose
    what to run: `asked` in the framework's own spelling, `ran` as fp32/bf16/fp16 (None: a mode
    the ladder has no rung for), `reason` the framework's own when it changed the request."""

    framework: str = ""
    asked: str = ""
    ran: str | None = None
    reason: str = ""
    driver: str = ""        # what built the framework for the loop ("HF Trainer"), if not the loop
    refused: bool = False   # the framework raised rather than run the precision on this device
    kind: ClassVar[str] = "framework_precision"


@dataclass(frozen=True)
class EngineBuilt(Event):
    """The loop built a DeepSpeed engine (`deepspeed.initialize`): what its config makes it do.
    `fp32_master`: its optimizer updates fp32 master weights of a module it cast to
    `precision` (DeepSpeed's mixed precision: no autocast, the module itself in bf16/fp16)."""

    framework: str = "DeepSpeed"
    zero_stage: int = 0
    precision: str = "fp32"
    fp32_master: bool = False
    accumulation_steps: int = 1          # the config's gradient_accumulation_steps
    clipping: float = 0.0                # the config's gradient_clipping (0: none)
    optimizer: str = ""                  # the class the engine's optimizer wraps
    scheduler: str = ""                  # the config's (or the client's) scheduler class, if any
    config_file: str | None = None       # the config's path, when it was given as one
    #: fp16: the loss scale the engine's optimizer starts with (its `cur_scale`/`loss_scale`),
    #: and the config key it comes from (`fp16.loss_scale` static, else
    #: `fp16.initial_scale_power`); 0 and "" without one
    loss_scale: float = 0.0
    loss_scale_key: str = ""
    kind: ClassVar[str] = "engine_built"


#: kind -> event class (`make_event`: events built from their kind's name).
EVENT_TYPES: dict[str, type[Event]] = {cls.kind: cls for cls in (
    MicroBatchFetched, Forward, Backward, ScalerInit, Scale, GetScale, Unscale, ScalerStep,
    OptimizerStep, Update, ZeroGrad, Clip, SchedulerStep, AutocastEntered,
    FrameworkPrecision, EngineBuilt)}


def make_event(kind: str, seq: int = 0, *, microbatch: int = -1, backwards: int = 0,
               site: Site | None = None, **fields: Any) -> Event:
    """An event of `kind` built outside a probe (tests, replayed traces)."""
    return EVENT_TYPES[kind](seq=seq, microbatch=microbatch, backwards=backwards, site=site,
                             **fields)


E = TypeVar("E", bound=Event)


def of_type(events: Iterable[Event], cls: type[E]) -> list[E]:
    """The events of type `cls`, in order."""
    return [e for e in events if isinstance(e, cls)]


@dataclass
class StepRecord:
    """One `optimizer.step()` as the optimizer saw it (the raw material of the judge; its
    gradients are released once no rung compares them again, hence not frozen)."""

    seq: int
    optimizer: int
    microbatch: int           # the micro-batch last consumed before the step
    backwards: int            # backward calls so far in the run
    group: int                # steps between the same two backward phases share a group
    grads: Mapping[str, torch.Tensor | None]
    site: Site | None
    via_scaler: int | None    # the scaler slot when called inside scaler.step
    #: micro-batches whose forward ran since the previous step group (matched by storage):
    #: what this step consumed, whatever order the loop fetched them in
    consumed: tuple[int, ...] = ()
    #: the learning rate of each parameter group as this step used it
    lrs: tuple[float, ...] = ()
    #: every gradient the step is about to apply is finite
    finite: bool = True


@dataclass(frozen=True)
class Snapshot:
    """Model state at the first step of a group: what the reference is evaluated at."""

    group: int
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    training: bool = True


__all__ = ["Event", "MicroBatchFetched", "Forward", "Backward", "ScalerInit", "Scale",
           "GetScale", "Unscale", "ScalerStep", "OptimizerStep", "Update", "ZeroGrad", "Clip",
           "SchedulerStep", "AutocastEntered", "StepRecord", "Snapshot", "EVENT_TYPES",
           "make_event", "of_type"]
