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
    #: micro-batches whose forward ran since the previous step group (matched by storage):
    #: what this step consumed, whatever order the loop fetched them in
    consumed: tuple[int, ...] = ()
    #: the learning rate of each parameter group as this step used it
    lrs: tuple[float, ...] = ()
    #: every gradient the step is about to apply is finite
    finite: bool = True


@dataclass
class Snapshot:
    """Model state at the first step of a group: what the reference is evaluated at."""

    group: int
    state: dict[str, torch.Tensor]
    training: bool


def storages(value: Any) -> Iterator[int]:
    """The storage addresses of the tensors in a (nested) micro-batch or forward argument."""
    if isinstance(value, torch.Tensor):
        try:
            yield value.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):   # meta / sparse tensors
            return
    elif isinstance(value, dict):
        for item in value.values():
            yield from storages(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from storages(item)


class MicroBatchIndex:
    """Which micro-batch a tensor belongs to, by its storage: every micro-batch ampdoctor hands
    out owns its storage, and what a loop does on the way to the model (`.to(device)` on the
    same device, slicing `x[:, :-1]`, `batch["input_ids"]`) keeps it."""

    def __init__(self, micro_batches: list[Any], indices: list[int] | None = None):
        self._by_storage: dict[int, int] = {}
        for index, mb in zip(indices or range(len(micro_batches)), micro_batches):
            for ptr in storages(mb):
                if ptr:
                    self._by_storage.setdefault(ptr, index)

    def find(self, args: Any, kwargs: Any) -> int | None:
        for ptr in storages((args, kwargs)):
            index = self._by_storage.get(ptr)
            if index is not None:
                return index
        return None


class ForwardAligner:
    """Forward hooks on a model: name the micro-batch each top-level forward consumes and, with
    `seed` set, run that forward under a fixed RNG state per micro-batch (dropout masks then
    match between the loop's runs and the reference) without touching the RNG stream outside
    the forward (randomness elsewhere still shows in the reproducibility rung)."""

    def __init__(self, index: MicroBatchIndex, seed: int | None,
                 on_forward: Callable[[int | None], None] | None = None):
        self.index = index
        self.seed = seed
        self.on_forward = on_forward
        self._forks: list[Any] = []
        self._handles: list[Any] = []
        self.depth = 0   # inside a top-level forward
        #: the micro-batch to seed by when a forward matches none (the one last fetched)
        self.fallback: Callable[[], int | None] | None = None

    def attach(self, model: torch.nn.Module) -> ForwardAligner:
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, always_call=True),
        ]
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module, args, kwargs):
        index = self.index.find(args, kwargs)
        if self.on_forward is not None:
            self.on_forward(index)
        key = index if index is not None else (self.fallback() if self.fallback else None)
        fork = None
        if self.seed is not None and key is not None:
            devices = ([torch.cuda.current_device()] if torch.cuda.is_available()
                       and torch.cuda.is_initialized() else [])
            fork = torch.random.fork_rng(devices=devices)
            fork.__enter__()
            torch.manual_seed(self.seed * 1_000_003 + key)
        self._forks.append(fork)
        self.depth += 1
        return None

    def _post(self, module, args, output):
        self.depth = max(0, self.depth - 1)
        fork = self._forks.pop() if self._forks else None
        if fork is not None:
            fork.__exit__(None, None, None)
        return None


class MicroBatchFeed(Sequence):
    """ampdoctor's own iterable around the micro-batches: records which one is handed out."""

    def __init__(self, micro_batches: list[Any], probe: Probe, indices: list[int] | None = None):
        self._items = list(micro_batches)
        self._probe = probe
        #: the session-wide index of each item (a reference run feeds one window's micro-batches)
        self._indices = list(indices) if indices is not None else list(range(len(self._items)))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._items)))]
        if index < 0:
            index += len(self._items)
        self._probe.on_microbatch(self._indices[index])
        return self._items[index]

    def __iter__(self) -> Iterator[Any]:
        for index, item in enumerate(self._items):
            self._probe.on_microbatch(self._indices[index])
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
        self._group_consumed: tuple[int, ...] = ()
        self.fetched = -1
        self._depth: dict[str, int] = {}
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
        if not self.forward_matched:
            self.current_microbatch = index
        self.fetched = index
        self.record("microbatch", data={"index": index})

    def on_forward(self, index: int | None) -> None:
        if index is not None:
            self.forward_matched = True
            self.current_microbatch = index
            self._consumed.append(index)
        self.record("forward", data={"index": index})

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
            self._group_consumed = tuple(sorted(set(self._consumed)))
            self._consumed = []
            if self.model is not None and self.capture_grads:
                self.snapshots[self._group] = Snapshot(
                    self._group,
                    {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
                    self.model.training,
                )
        grads: dict[str, torch.Tensor | None] = {}
        finite = True
        for index, param in enumerate(_optimizer_params(optimizer)):
            if param.grad is None:
                if self.capture_grads:
                    grads[self.param_name(param, slot, index)] = None
                continue
            if self.capture_grads:
                grads[self.param_name(param, slot, index)] = param.grad.detach().to(
                    "cpu", torch.float32, copy=True)
            elif finite:
                finite = bool(torch.isfinite(param.grad).all())
        if self.capture_grads:
            finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads.values())
        lrs = tuple(float(g["lr"]) for g in optimizer.param_groups
                    if isinstance(g.get("lr"), (int, float, torch.Tensor)))
        site = self.finder.from_frame(_caller(2))
        self.steps.append(StepRecord(len(self.events), slot, self.current_microbatch,
                                     self.backward_count, self._group, grads, site,
                                     self._scaler_step_slot, self._group_consumed, lrs, finite))
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
        norm_type = args[1] if len(args) > 1 else kwargs.get("norm_type", 2.0)
        data = {"kind": kind, "max_norm": None if max_norm is None else float(max_norm),
                "norm_type": float(norm_type) if kind == "norm" else None,
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
        lr_before = None
        try:
            lr_before = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            pass
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
                     data={"type": type(self).__name__, "lr": lr, "lr_before": lr_before,
                           "scheduler": id(self),
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
                                           "dtype": dtype,
                                           "created_at": getattr(self, "_ampdoctor_site", None)})
        return result
    return __enter__


#: `dropout: off`: every functional dropout (which nn.Dropout, nn.MultiheadAttention and the
#: Transformer layers call) runs with p = 0 while this is set, whatever `model.train()` says.
DROPOUT_OFF = False

_DROPOUT_FUNCTIONS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                      "feature_alpha_dropout")


def _wrap_dropout(original):
    @functools.wraps(original)
    def dropout(input, p=0.5, *args, **kwargs):
        if DROPOUT_OFF:
            p = 0.0
            kwargs.pop("p", None)
        return original(input, p, *args, **kwargs)
    return dropout


def _wrap_sdpa(original):
    @functools.wraps(original)
    def scaled_dot_product_attention(*args, **kwargs):
        if DROPOUT_OFF:
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


def _wrap_random(original, name: str):
    @functools.wraps(original)
    def draw(*args, **kwargs):
        probe = _active()
        if probe is not None and not probe.inside("random") and (
                probe.aligner is None or probe.aligner.depth == 0) and probe.random_site is None:
            probe.random_site = probe.finder.from_frame(_caller(2))
        if probe is None:
            return original(*args, **kwargs)
        probe.enter("random")
        try:
            return original(*args, **kwargs)
        finally:
            probe.leave("random")
    return draw


def _wrap_autocast_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        probe = _active()
        if probe is not None:
            # where the dtype was chosen: an autocast built once and entered in the loop
            try:
                self._ampdoctor_site = probe.finder.from_frame(_caller(2))
            except AttributeError:
                pass
    return __init__


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
    patcher.setattr(autocast_cls, "__init__", _wrap_autocast_init(autocast_cls.__init__))

    for name in _RANDOM_FUNCTIONS:
        if hasattr(torch, name):
            patcher.setattr(torch, name, _wrap_random(getattr(torch, name), name))

    functional = torch.nn.functional
    for name in _DROPOUT_FUNCTIONS:
        if hasattr(functional, name):
            patcher.setattr(functional, name, _wrap_dropout(getattr(functional, name)))
    patcher.setattr(functional, "scaled_dot_product_attention",
                    _wrap_sdpa(functional.scaled_dot_product_attention))

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
