"""The wrappers around torch that feed the active probe: backward, zero_grad, the clipping
functions, LR schedulers, autocast and the optimizer step (the GradScaler's are in
`scaler_wrappers`). Each is inert while no probe is active, and always calls the original;
`install` patches them all in through a `Patcher`, which restores torch exactly on any exit."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from . import randomness, scaler_wrappers
from .callsite import Site
from .events import AutocastEntered, Clip, SchedulerStep, ZeroGrad
from .patches import Patcher
from .recorder import Probe
from .wrapping import active, caller


def _backward_site(probe: Probe, frame: FrameType) -> Site | None:
    """The user's line of a backward: its caller, or - when a framework calls backward (the HF
    Trainer, Lightning's automatic optimization) - the line of the user's training step that
    computed the loss."""
    site = probe.finder.from_frame(frame)
    loss_site, probe.loss_site = probe.loss_site, None
    if loss_site is None or probe.finder.direct_user_site(frame) is not None:
        return site
    if site is not None and (site.file, site.function) == (loss_site.file, loss_site.function):
        # the user's step called the framework's backward (manual_backward,
        # accelerator.backward): that call is the user's line
        return site
    return loss_site


def _wrap_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        probe = active()
        if probe is None or probe.inside("backward"):
            return original(self, *args, **kwargs)
        probe.on_backward(self, _backward_site(probe, caller(2)))
        if probe.before_backward is not None:
            probe.before_backward(probe, self)
        probe.enter("backward")
        try:
            return original(self, *args, **kwargs)
        finally:
            probe.leave("backward")
    return backward


def _wrap_autograd_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        probe = active()
        if probe is None or probe.inside("backward"):
            return original(tensors, *args, **kwargs)
        first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
        site = _backward_site(probe, caller(2))
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


def _wrap_zero_grad(original: Callable[..., Any], owner: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = active()
        if probe is not None and not probe.inside("zero_grad"):
            opt = probe.optimizer_slot(self) if owner == "optimizer" else None
            probe.record(ZeroGrad, site=probe.finder.from_frame(caller(2)), optimizer=opt,
                         owner=owner)
        if probe is None:
            return original(self, *args, **kwargs)
        probe.enter("zero_grad")
        try:
            return original(self, *args, **kwargs)
        finally:
            probe.leave("zero_grad")
    return zero_grad


def _wrap_clip(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        probe = active()
        if probe is None or probe.inside("clip"):
            return original(parameters, *args, **kwargs)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        site = probe.finder.from_frame(caller(2))
        probe.enter("clip")
        try:
            result = original(params, *args, **kwargs)
        finally:
            probe.leave("clip")
        max_norm = args[0] if args else kwargs.get("max_norm", kwargs.get("clip_value"))
        norm_type = args[1] if len(args) > 1 else kwargs.get("norm_type", 2.0)
        probe.record(Clip, site=site, clip_kind=kind,
                     max_norm=None if max_norm is None else float(max_norm),
                     norm_type=float(norm_type) if kind == "norm" else None,
                     param_ids=tuple(id(p) for p in params),
                     total_norm=float(result) if isinstance(result, torch.Tensor) else None)
        return result
    return clip


def _wrap_total_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """`get_total_norm(tensors, norm_type, ...)`, the first half of the two-step clip: remember
    its norm type for the `clip_grads_with_norm_` that uses the norm (nothing is recorded)."""
    @functools.wraps(original)
    def get_total_norm(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        probe = active()
        if probe is None or probe.inside("clip"):
            return original(tensors, *args, **kwargs)
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        result = original(grads, *args, **kwargs)
        norm_type = args[0] if args else kwargs.get("norm_type", 2.0)
        probe.total_norms = [*probe.total_norms[-(_TOTAL_NORMS_KEPT - 1):],
                             (result, float(norm_type), {id(g) for g in grads})]
        return result
    return get_total_norm


#: How many recent `get_total_norm` results the probe keeps to match a later clip with.
_TOTAL_NORMS_KEPT = 8


def _norm_type_of(probe: Probe, total_norm: Any, params: list[torch.Tensor]) -> float:
    """The norm type of the `get_total_norm` call that computed `total_norm`: the same tensor,
    else one over exactly these parameters' gradients; 2.0 when none was observed."""
    grad_ids = {id(p.grad) for p in params if p.grad is not None}
    for result, norm_type, _ in reversed(probe.total_norms):
        if result is total_norm:
            return norm_type
    for _, norm_type, ids in reversed(probe.total_norms):
        if ids == grad_ids:
            return norm_type
    return 2.0


def _wrap_clip_with_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """`clip_grads_with_norm_(parameters, max_norm, total_norm)`, the second half of the
    two-step clip: one Clip of kind "norm", as `clip_grad_norm_` gives."""
    @functools.wraps(original)
    def clip_grads_with_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        probe = active()
        if probe is None or probe.inside("clip"):
            return original(parameters, *args, **kwargs)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        site = probe.finder.from_frame(caller(2))
        max_norm = args[0] if args else kwargs.get("max_norm")
        total_norm = args[1] if len(args) > 1 else kwargs.get("total_norm")
        norm_type = _norm_type_of(probe, total_norm, params)
        probe.enter("clip")
        try:
            result = original(params, *args, **kwargs)
        finally:
            probe.leave("clip")
        probe.record(Clip, site=site, clip_kind="norm",
                     max_norm=None if max_norm is None else float(max_norm),
                     norm_type=norm_type, param_ids=tuple(id(p) for p in params),
                     total_norm=None if total_norm is None else float(total_norm))
        return result
    return clip_grads_with_norm_


#: Warnings said again at the user's line, shown once per line as Python's default filter does.
_REPLAYED: set[tuple[Any, ...]] = set()


def _wrap_scheduler_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = active()
        if probe is None or probe.inside("scheduler") or probe.inside("scheduler_init"):
            return original(self, *args, **kwargs)
        site = probe.finder.from_frame(caller(2))
        optimizer = getattr(self, "optimizer", None)
        slot = probe.optimizer_slot(optimizer) if optimizer is not None else None
        lr_before = None
        with contextlib.suppress(AttributeError, IndexError, KeyError, TypeError, ValueError):
            lr_before = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
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
        # (ReduceLROnPlateau before its first step, custom schedulers: no last LR)
        with contextlib.suppress(Exception):
            lr = float(self.get_last_lr()[0])
        probe.record(SchedulerStep, site=site, optimizer=slot,
                     scheduler_type=type(self).__name__, lr=lr, lr_before=lr_before,
                     scheduler=id(self), last_epoch=getattr(self, "last_epoch", None))
        return result
    return step


#: for the schedules of frameworks that are not torch LRSchedulers (probe/deepspeed.py)
wrap_scheduler_step = _wrap_scheduler_step


def _wrap_initial_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _initial_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = active()
        if probe is None:
            return original(self, *args, **kwargs)
        probe.enter("scheduler_init")
        try:
            return original(self, *args, **kwargs)
        finally:
            probe.leave("scheduler_init")
    return _initial_step


def _wrap_autocast_enter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __enter__(self: Any) -> Any:
        result = original(self)
        probe = active()
        if probe is not None:
            device_type = getattr(self, "device", None)
            enabled = dtype = None
            if isinstance(device_type, str):
                enabled = torch.is_autocast_enabled(device_type)
                dtype = str(torch.get_autocast_dtype(device_type)).replace("torch.", "")
            probe.record(AutocastEntered, device_type=device_type, enabled=enabled, dtype=dtype,
                         created_at=getattr(self, "_ampdoctor_site", None))
        return result
    return __enter__


def _wrap_autocast_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        probe = active()
        if probe is not None:
            # where the dtype was chosen: an autocast built once and entered in the loop
            with contextlib.suppress(AttributeError):
                self._ampdoctor_site = probe.finder.from_frame(caller(2))
    return __init__


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    probe = active()
    if probe is None:
        return None
    if probe.framework_step is not None and probe.framework_step(optimizer):
        return None   # an engine's inner optimizer: the engine's step is recorded (deepspeed)
    closure = kwargs.get("closure", args[0] if args else None)
    if not callable(closure):
        probe.on_optimizer_step(optimizer)
        return None
    # A step handed a closure (Lightning's automatic optimization, LBFGS) runs the last
    # micro-batch's forward and backward - and the unscale and the clip - inside the step: the
    # gradient it consumes exists only once the closure has run, so that is when it is read.
    seen: list[bool] = []

    def closure_then_observe() -> Any:
        result = closure()
        if not seen and active() is probe:
            seen.append(True)
            probe.on_optimizer_step(optimizer)
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_observe}
    return (closure_then_observe, *args[1:]), kwargs


def install(patcher: Patcher) -> None:
    """Patch torch so that an active probe sees every call it records (GradScaler's through
    `scaler_wrappers.install`)."""
    import torch.nn.utils as nn_utils
    from torch.amp import autocast_mode
    from torch.nn.utils import clip_grad
    from torch.optim import lr_scheduler
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    patcher.setattr(torch.Tensor, "backward", _wrap_backward(torch.Tensor.backward))
    patcher.setattr(torch.autograd, "backward", _wrap_autograd_backward(torch.autograd.backward))

    scaler_wrappers.install(patcher)

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
    # the two-step clip (torch >= 2.6): public in torch.nn.utils, and in clip_grad too where
    # that torch defines it there. torch.nn.utils.clip_grad_norm_ calls the private
    # _get_total_norm / _clip_grads_with_norm_, left alone; a torch whose clip_grad_norm_ calls
    # the public names reaches these wrappers inside "clip", where they record nothing.
    for name, wrap in (("get_total_norm", _wrap_total_norm),
                       ("clip_grads_with_norm_", _wrap_clip_with_norm)):
        original = getattr(clip_grad, name, None) or getattr(nn_utils, name, None)
        if original is None:
            continue
        wrapper = wrap(original)
        for module in (clip_grad, nn_utils):
            if getattr(module, name, None) is original:
                patcher.setattr(module, name, wrapper)

    base = lr_scheduler.LRScheduler
    for obj in vars(lr_scheduler).values():
        if isinstance(obj, type) and issubclass(obj, base) and "step" in vars(obj):
            patcher.setattr(obj, "step", _wrap_scheduler_step(vars(obj)["step"]))
    if "_initial_step" in vars(base):
        patcher.setattr(base, "_initial_step", _wrap_initial_step(vars(base)["_initial_step"]))

    autocast_cls = autocast_mode.autocast
    patcher.setattr(autocast_cls, "__enter__", _wrap_autocast_enter(autocast_cls.__enter__))
    patcher.setattr(autocast_cls, "__init__", _wrap_autocast_init(autocast_cls.__init__))

    randomness.install(patcher)

    patcher.add_handle(register_optimizer_step_pre_hook(_step_pre_hook))
