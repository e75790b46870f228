"""The probe: wrappers around torch that record what the user's loop does, as events.

ampdoctor observes the loop; it never rewrites it. Every wrapper calls the original and, when a
probe is active, appends an `Event` carrying the user's call site and the micro-batch last
handed out. At every `optimizer.step()` (global pre-hook) the probe also records the gradients
the step is about to consume and the parameters it sees (`StepRecord`), the raw material of the
teacher-forced comparison.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .callsite import CallSiteFinder, Site
from .patches import Patcher

#: The probe currently recording, if any. Wrappers are inert while it is None.
ACTIVE: Probe | None = None


@dataclass
class Event:
    seq: int
    kind: str
    microbatch: int
    site: Site | None
    optimizer: int | None = None
    scaler: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    backwards: int = 0        # backward calls so far in the run


@dataclass
class StepRecord:
    """One `optimizer.step()` as the optimizer saw it."""

    seq: int
    optimizer: int
    microbatch: int           # last micro-batch handed out before the step
    backwards: int            # backward calls so far in the run
    group: int                # steps between the same two backward phases share a group
    grads: dict[str, torch.Tensor | None]
    site: Site | None
    via_scaler: int | None    # the scaler slot when called inside scaler.step


@dataclass
class Snapshot:
    """Model state at the first step of a group: what the reference is evaluated at."""

    group: int
    state: dict[str, torch.Tensor]
    training: bool


class MicroBatchFeed(Sequence):
    """ampdoctor's own iterable around the micro-batches: records which one is handed out."""

    def __init__(self, micro_batches: list[Any], probe: Probe):
        self._items = list(micro_batches)
        self._probe = probe

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._items)))]
        if index < 0:
            index += len(self._items)
        self._probe.on_microbatch(index)
        return self._items[index]

    def __iter__(self) -> Iterator[Any]:
        for index, item in enumerate(self._items):
            self._probe.on_microbatch(index)
            yield item


def _grad_norm(params: list[torch.Tensor]) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    with torch.no_grad():
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
    return float(total)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class Probe:
    """Records one run of the user's loop."""

    def __init__(self, finder: CallSiteFinder, model: torch.nn.Module | None = None,
                 optimizers: list[torch.optim.Optimizer] | None = None):
        self.finder = finder
        self.events: list[Event] = []
        self.steps: list[StepRecord] = []
        self.snapshots: dict[int, Snapshot] = {}
        self.current_microbatch = -1
        self.model = model
        self.param_names: dict[int, str] = {}
        if model is not None:
            self.param_names = {id(p): name for name, p in model.named_parameters()}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._scalers: list[Any] = []
        for opt in optimizers or []:
            self.optimizer_slot(opt)
        self.backward_count = 0
        self._group = -1
        self._backwards_at_group = -1
        self._depth: dict[str, int] = {}
        self._scaler_step_slot: int | None = None
        self.optimizer_step_count = 0
        #: Called as inject(probe, loss_tensor) before each backward (overflow injection).
        self.before_backward: Callable[[Probe, torch.Tensor], None] | None = None
        self.capture_grads = True

    # --- bookkeeping --------------------------------------------------------------------
    def optimizer_slot(self, optimizer: Any) -> int:
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

    @property
    def optimizers(self) -> list[Any]:
        return list(self._optimizers)

    @property
    def scalers(self) -> list[Any]:
        return list(self._scalers)

    def param_name(self, param: torch.Tensor, slot: int, index: int) -> str:
        return self.param_names.get(id(param), f"optimizer{slot}.param{index}")

    def record(self, kind: str, site: Site | None = None, **kw: Any) -> Event:
        event = Event(len(self.events), kind, self.current_microbatch,
                      site if site is not None else self.finder.from_frame(_caller(3)), **kw)
        event.backwards = self.backward_count
        self.events.append(event)
        return event

    def enter(self, name: str) -> int:
        self._depth[name] = self._depth.get(name, 0) + 1
        return self._depth[name]

    def leave(self, name: str) -> None:
        self._depth[name] -= 1

    def inside(self, name: str) -> bool:
        return self._depth.get(name, 0) > 0

    # --- events -------------------------------------------------------------------------
    def on_microbatch(self, index: int) -> None:
        self.current_microbatch = index
        self.record("microbatch", data={"index": index})

    def on_backward(self, tensor: torch.Tensor, site: Site | None) -> None:
        data: dict[str, Any] = {}
        scaled_by = getattr(tensor, "_ampdoctor_scale", None)
        if scaled_by is not None:
            data["scaled_by"] = scaled_by
        if tensor.numel() == 1:
            data["value"] = float(tensor.detach().float())
        self.backward_count += 1
        self.record("backward", site=site, data=data)

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        slot = self.optimizer_slot(optimizer)
        if self.backward_count != self._backwards_at_group:
            # First step since new gradients were computed: snapshot the parameters all of
            # this group's steps were computed at (a second optimizer's pre-hook would
            # otherwise see the first one's update).
            self._group += 1
            self._backwards_at_group = self.backward_count
            if self.model is not None and self.capture_grads:
                self.snapshots[self._group] = Snapshot(
                    self._group,
                    {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
                    self.model.training,
                )
        grads: dict[str, torch.Tensor | None] = {}
        if self.capture_grads:
            for index, param in enumerate(_optimizer_params(optimizer)):
                name = self.param_name(param, slot, index)
                grads[name] = None if param.grad is None else param.grad.detach().to(
                    "cpu", torch.float32, copy=True)
        site = self.finder.from_frame(_caller(2))
        self.steps.append(StepRecord(len(self.events), slot, self.current_microbatch,
                                     self.backward_count, self._group, grads, site,
                                     self._scaler_step_slot))
        self.optimizer_step_count += 1
        self.record("step", site=site, optimizer=slot,
                    data={"via_scaler": self._scaler_step_slot is not None})


def _caller(depth: int):
    import sys
    return sys._getframe(depth)


# ---------------------------------------------------------------------------------------
# The wrappers. Each is inert unless a probe is active, and always calls the original.
# ---------------------------------------------------------------------------------------

def _active() -> Probe | None:
    return ACTIVE


def _wrap_backward(original):
    @functools.wraps(original)
    def backward(self, *args, **kwargs):
        probe = _active()
        if probe is None or probe.inside("backward"):
            return original(self, *args, **kwargs)
        site = probe.finder.from_frame(_caller(2))
        probe.on_backward(self, site)
        if probe.before_backward is not None:
            probe.before_backward(probe, self)
        probe.enter("backward")
        try:
            return original(self, *args, **kwargs)
        finally:
            probe.leave("backward")
    return backward


def _wrap_autograd_backward(original):
    @functools.wraps(original)
    def backward(tensors, *args, **kwargs):
        probe = _active()
        if probe is None or probe.inside("backward"):
            return original(tensors, *args, **kwargs)
        first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
        site = probe.finder.from_frame(_caller(2))
        if isinstance(first, torch.Tensor):
            probe.on_backward(first, site)
            if probe.before_backward is not None:
                probe.before_backward(probe, first)
        probe.enter("backward")
        try:
            return original(tensors, *args, **kwargs)
        finally:
            probe.leave("backward")
    return backward


def _scale_value(scaler) -> float | None:
    """The scaler's current scale through its public API (None when disabled)."""
    if not scaler.is_enabled():
        return None
    probe = _active()
    if probe is not None:
        probe.enter("internal")
    try:
        return float(scaler.get_scale())
    finally:
        if probe is not None:
            probe.leave("internal")


def _wrap_get_scale(original):
    @functools.wraps(original)
    def get_scale(self):
        result = original(self)
        probe = _active()
        if probe is not None and not probe.inside("internal") and not probe.inside("scaler_step"):
            probe.record("get_scale", scaler=probe.scaler_slot(self),
                         site=probe.finder.from_frame(_caller(2)),
                         data={"scale": float(result)})
        return result
    return get_scale


def _wrap_scaler_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        probe = _active()
        if probe is None:
            return
        slot = probe.scaler_slot(self)
        enabled = bool(self.is_enabled())
        data: dict[str, Any] = {"enabled": enabled}
        if enabled:  # a disabled GradScaler does not even keep its settings
            data.update(init_scale=_scale_value(self),
                        growth_interval=self.get_growth_interval(),
                        backoff_factor=self.get_backoff_factor(),
                        growth_factor=self.get_growth_factor())
        probe.record("scaler_init", scaler=slot, data=data)
    return __init__


def _wrap_scale(original):
    @functools.wraps(original)
    def scale(self, outputs):
        probe = _active()
        if probe is None:
            return original(self, outputs)
        slot = probe.scaler_slot(self)
        already = getattr(outputs, "_ampdoctor_scale", None) if isinstance(outputs, torch.Tensor) else None
        result = original(self, outputs)
        value = _scale_value(self)
        probe.record("scale", scaler=slot, data={"scale": value, "enabled": self.is_enabled(),
                                                  "input_already_scaled": already})
        if isinstance(result, torch.Tensor) and value is not None:
            try:
                result._ampdoctor_scale = value * (already or 1.0)
            except (AttributeError, RuntimeError):
                pass
        return result
    return scale


def _wrap_unscale(original):
    @functools.wraps(original)
    def unscale_(self, optimizer):
        probe = _active()
        if probe is None:
            return original(self, optimizer)
        slot = probe.scaler_slot(self)
        opt_slot = probe.optimizer_slot(optimizer)
        params = _optimizer_params(optimizer)
        before = _grad_norm(params) if self.is_enabled() else None
        event = probe.record("unscale", scaler=slot, optimizer=opt_slot, data={
            "scale": _scale_value(self), "enabled": self.is_enabled(),
            "inside_step": probe.inside("scaler_step"), "norm_before": before})
        try:
            result = original(self, optimizer)
        except RuntimeError as exc:
            event.data["error"] = str(exc)
            raise
        event.data["norm_after"] = _grad_norm(params) if self.is_enabled() else None
        return result
    return unscale_


def _wrap_scaler_step(original):
    @functools.wraps(original)
    def step(self, optimizer, *args, **kwargs):
        probe = _active()
        if probe is None:
            return original(self, optimizer, *args, **kwargs)
        slot = probe.scaler_slot(self)
        opt_slot = probe.optimizer_slot(optimizer)
        site = probe.finder.from_frame(_caller(2))
        event = probe.record("scaler_step", site=site, scaler=slot, optimizer=opt_slot,
                             data={"scale": _scale_value(self), "enabled": self.is_enabled()})
        before = probe.optimizer_step_count
        previous, probe._scaler_step_slot = probe._scaler_step_slot, slot
        probe.enter("scaler_step")
        try:
            return original(self, optimizer, *args, **kwargs)
        finally:
            probe.leave("scaler_step")
            probe._scaler_step_slot = previous
            event.data["skipped"] = probe.optimizer_step_count == before
    return step


def _wrap_update(original):
    @functools.wraps(original)
    def update(self, new_scale=None):
        probe = _active()
        if probe is None:
            return original(self, new_scale)
        slot = probe.scaler_slot(self)
        before = _scale_value(self)
        event = probe.record("update", scaler=slot, site=probe.finder.from_frame(_caller(2)),
                             data={"scale_before": before})
        try:
            result = original(self, new_scale)
        except Exception as exc:
            event.data["error"] = str(exc)
            raise
        event.data["scale_after"] = _scale_value(self)
        return result
    return update


def _wrap_zero_grad(original, owner: str):
    @functools.wraps(original)
    def zero_grad(self, *args, **kwargs):
        probe = _active()
        if probe is not None and not probe.inside("zero_grad"):
            data = {"owner": owner}
            opt = None
            if owner == "optimizer":
                opt = probe.optimizer_slot(self)
            probe.record("zero_grad", site=probe.finder.from_frame(_caller(2)), optimizer=opt,
                         data=data)
        if probe is None:
            return original(self, *args, **kwargs)
        probe.enter("zero_grad")
        try:
            return original(self, *args, **kwargs)
        finally:
            probe.leave("zero_grad")
    return zero_grad


def _wrap_clip(original, kind: str):
    @functools.wraps(original)
    def clip(parameters, *args, **kwargs):
        probe = _active()
        if probe is None or probe.inside("clip"):
            return original(parameters, *args, **kwargs)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        site = probe.finder.from_frame(_caller(2))
        probe.enter("clip")
        try:
            result = original(params, *args, **kwargs)
        finally:
            probe.leave("clip")
        max_norm = args[0] if args else kwargs.get("max_norm", kwargs.get("clip_value"))
        data = {"kind": kind, "max_norm": None if max_norm is None else float(max_norm),
                "param_ids": [id(p) for p in params]}
        if isinstance(result, torch.Tensor):
            data["total_norm"] = float(result)
        probe.record("clip", site=site, data=data)
        return result
    return clip


#: Warnings said again at the user's line, shown once per line as Python's default filter does.
_REPLAYED: set[tuple[Any, ...]] = set()


def _wrap_scheduler_step(original):
    @functools.wraps(original)
    def step(self, *args, **kwargs):
        probe = _active()
        if probe is None or probe.inside("scheduler") or probe.inside("scheduler_init"):
            return original(self, *args, **kwargs)
        site = probe.finder.from_frame(_caller(2))
        optimizer = getattr(self, "optimizer", None)
        slot = probe.optimizer_slot(optimizer) if optimizer is not None else None
        probe.enter("scheduler")
        try:
            with warnings.catch_warnings(record=True) as caught:
                result = original(self, *args, **kwargs)
        finally:
            probe.leave("scheduler")
        # torch warns at its caller's line (stacklevel 2), which is now this wrapper: say it
        # again at the user's scheduler call.
        for w in caught:
            where = (site.file, site.line) if site else (w.filename, w.lineno)
            key = (*where, w.category, str(w.message))
            if key not in _REPLAYED:
                _REPLAYED.add(key)
                warnings.warn_explicit(w.message, w.category, *where)
        lr = None
        try:
            lr = float(self.get_last_lr()[0])
        except Exception:  # ReduceLROnPlateau before its first step, custom schedulers
            pass
        probe.record("scheduler", site=site, optimizer=slot,
                     data={"type": type(self).__name__, "lr": lr, "scheduler": id(self),
                           "last_epoch": getattr(self, "last_epoch", None)})
        return result
    return step


def _wrap_initial_step(original):
    @functools.wraps(original)
    def _initial_step(self, *args, **kwargs):
        probe = _active()
        if probe is None:
            return original(self, *args, **kwargs)
        probe.enter("scheduler_init")
        try:
            return original(self, *args, **kwargs)
        finally:
            probe.leave("scheduler_init")
    return _initial_step


def _wrap_autocast_enter(original):
    @functools.wraps(original)
    def __enter__(self):
        result = original(self)
        probe = _active()
        if probe is not None:
            device_type = getattr(self, "device", None)
            enabled = dtype = None
            if isinstance(device_type, str):
                enabled = torch.is_autocast_enabled(device_type)
                dtype = str(torch.get_autocast_dtype(device_type)).replace("torch.", "")
            probe.record("autocast", data={"device_type": device_type, "enabled": enabled,
                                           "dtype": dtype})
        return result
    return __enter__


def _step_pre_hook(optimizer, args, kwargs):
    probe = _active()
    if probe is not None:
        probe.on_optimizer_step(optimizer)


def install(patcher: Patcher) -> None:
    """Patch torch so that an active probe sees every event of DESIGN §2."""
    from torch.amp import grad_scaler
    from torch.amp import autocast_mode
    from torch.nn.utils import clip_grad
    import torch.nn.utils as nn_utils
    from torch.optim import lr_scheduler
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    patcher.setattr(torch.Tensor, "backward", _wrap_backward(torch.Tensor.backward))
    patcher.setattr(torch.autograd, "backward", _wrap_autograd_backward(torch.autograd.backward))

    scaler_cls = grad_scaler.GradScaler
    patcher.setattr(scaler_cls, "__init__", _wrap_scaler_init(scaler_cls.__init__))
    patcher.setattr(scaler_cls, "scale", _wrap_scale(scaler_cls.scale))
    patcher.setattr(scaler_cls, "unscale_", _wrap_unscale(scaler_cls.unscale_))
    patcher.setattr(scaler_cls, "step", _wrap_scaler_step(scaler_cls.step))
    patcher.setattr(scaler_cls, "update", _wrap_update(scaler_cls.update))
    patcher.setattr(scaler_cls, "get_scale", _wrap_get_scale(scaler_cls.get_scale))

    patcher.setattr(torch.optim.Optimizer, "zero_grad",
                    _wrap_zero_grad(torch.optim.Optimizer.zero_grad, "optimizer"))
    patcher.setattr(torch.nn.Module, "zero_grad",
                    _wrap_zero_grad(torch.nn.Module.zero_grad, "module"))

    for name, kind in (("clip_grad_norm_", "norm"), ("clip_grad_value_", "value"),
                       ("clip_grad_norm", "norm")):
        original = getattr(clip_grad, name, None)
        if original is None:
            continue
        wrapper = _wrap_clip(original, kind)
        patcher.setattr(clip_grad, name, wrapper)
        if getattr(nn_utils, name, None) is original:
            patcher.setattr(nn_utils, name, wrapper)

    base = lr_scheduler.LRScheduler
    for obj in vars(lr_scheduler).values():
        if isinstance(obj, type) and issubclass(obj, base) and "step" in vars(obj):
            patcher.setattr(obj, "step", _wrap_scheduler_step(vars(obj)["step"]))
    if "_initial_step" in vars(base):
        patcher.setattr(base, "_initial_step", _wrap_initial_step(vars(base)["_initial_step"]))

    autocast_cls = autocast_mode.autocast
    patcher.setattr(autocast_cls, "__enter__", _wrap_autocast_enter(autocast_cls.__enter__))

    patcher.add_handle(register_optimizer_step_pre_hook(_step_pre_hook))


def activate(probe: Probe | None) -> Probe | None:
    """Make `probe` the recording one; return the previous."""
    global ACTIVE
    previous, ACTIVE = ACTIVE, probe
    return previous


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


__all__ = ["Event", "StepRecord", "Snapshot", "Probe", "MicroBatchFeed", "install", "activate",
           "Path"]
