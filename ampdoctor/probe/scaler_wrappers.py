"""The wrappers around `torch.amp.GradScaler` that feed the active probe: its construction,
`scale`, `unscale_`, `step`, `update`, `get_scale` and `load_state_dict`. Each is inert while no
probe is active and always calls the original; `install` patches them in through a `Patcher`
(`wrappers.install` calls it with the others)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.amp import GradScaler

from ..core.safetext import MESSAGE_LIMIT, cut, safe_str
from . import recorder
from .events import GetScale, Scale, ScalerInit, ScalerStep, Unscale, Update
from .patches import Patcher
from .recorder import Probe, optimizer_params
from .wrapping import active, caller, grad_norm


def _scale_value(scaler: GradScaler) -> float | None:
    """The scaler's current scale through its public API (None when disabled)."""
    if not scaler.is_enabled():
        return None
    probe = active()
    if probe is not None:
        probe.enter("internal")
    try:
        return float(scaler.get_scale())
    finally:
        if probe is not None:
            probe.leave("internal")


def _wrap_get_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_scale(self: GradScaler) -> Any:
        result = original(self)
        probe = active()
        if probe is not None and not probe.inside("internal") and not probe.inside("scaler_step"):
            probe.record(GetScale, scaler=probe.scaler_slot(self),
                         site=probe.finder.from_frame(caller(2)), scale=float(result))
        return result
    return get_scale


def _wrap_scaler_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: GradScaler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        probe = active()
        if probe is None:
            return
        slot = probe.scaler_slot(self)
        enabled = bool(self.is_enabled())
        settings: dict[str, Any] = {}
        start_scale = recorder.current_settings().start_scale
        if enabled and start_scale is not None and self._scale is None:
            self._init_scale = start_scale   # read lazily at the first scale()
        if enabled:  # a disabled GradScaler does not even keep its settings
            settings = dict(init_scale=_scale_value(self),
                            growth_interval=self.get_growth_interval(),
                            backoff_factor=self.get_backoff_factor(),
                            growth_factor=self.get_growth_factor())
        probe.record(ScalerInit, scaler=slot, enabled=enabled, **settings)
    return __init__


def _wrap_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: GradScaler, outputs: Any) -> Any:
        probe = active()
        if probe is None:
            return original(self, outputs)
        slot = probe.scaler_slot(self)
        already = (getattr(outputs, "_ampdoctor_scale", None)
                   if isinstance(outputs, torch.Tensor) else None)
        result = original(self, outputs)
        seen = probe.scales_seen.get(slot)
        current = getattr(self, "_scale", None)   # a disabled scaler has none
        if seen is not None and current is not None and seen[0] is current:
            value = seen[1]   # no update() since: the same scale, without a device sync
        else:
            value = _scale_value(self)
            probe.scales_seen[slot] = (current, value)
        probe.record(Scale, scaler=slot, scale=value, enabled=bool(self.is_enabled()),
                     input_already_scaled=already, reaches=_reaches(probe, slot, result))
        if isinstance(result, torch.Tensor) and value is not None:
            with contextlib.suppress(AttributeError, RuntimeError):
                result._ampdoctor_scale = value * (already or 1.0)  # type: ignore[attr-defined]
        return result
    return scale


#: Scaled losses walked per scaler: a scaler's later losses are taken to reach what its first
#: ones reached (the judgement, `rules.scaler_ownership`, takes the union); and in all (a loop
#: that builds a fresh GradScaler per step would otherwise walk every loss).
REACH_WALKS = 8
REACH_WALKS_IN_ALL = 64


def _reaches(probe: Probe, slot: int, result: Any) -> tuple[int, ...] | None:
    """The leaves (parameters) a scaled loss's backward reaches, by their id(): read from its
    autograd graph (the leaves that still require a gradient) only while two enabled
    GradScalers exist (whose losses and optimizers must not mix), for a scaler's first
    REACH_WALKS losses."""
    if (not isinstance(result, torch.Tensor) or result.grad_fn is None
            or probe.reach_walks.get(slot, 0) >= REACH_WALKS
            or sum(probe.reach_walks.values()) >= REACH_WALKS_IN_ALL
            or probe.enabled_scalers() < 2):
        return None
    probe.reach_walks[slot] = probe.reach_walks.get(slot, 0) + 1
    leaves: set[int] = set()
    seen: set[int] = set()
    stack: list[Any] = [result.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)   # AccumulateGrad: a leaf's gradient
        # a leaf frozen since the forward (a GAN's D during G's step) gets no gradient
        if isinstance(variable, torch.Tensor) and variable.requires_grad:
            leaves.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    return tuple(sorted(leaves))


def _wrap_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_(self: GradScaler, optimizer: torch.optim.Optimizer) -> Any:
        probe = active()
        if probe is None:
            return original(self, optimizer)
        slot = probe.scaler_slot(self)
        opt_slot = probe.optimizer_slot(optimizer)
        params = optimizer_params(optimizer)
        before = grad_norm(params) if self.is_enabled() else None
        event = probe.record(Unscale, scaler=slot, optimizer=opt_slot, scale=_scale_value(self),
                             enabled=bool(self.is_enabled()),
                             inside_step=probe.inside("scaler_step"), norm_before=before)
        try:
            result = original(self, optimizer)
        except RuntimeError as exc:
            probe.complete(event, error=cut(safe_str(exc), MESSAGE_LIMIT))
            raise
        probe.complete(event, norm_after=grad_norm(params) if self.is_enabled() else None)
        return result
    return unscale_


def _wrap_scaler_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
             ) -> Any:
        probe = active()
        if probe is None:
            return original(self, optimizer, *args, **kwargs)
        slot = probe.scaler_slot(self)
        opt_slot = probe.optimizer_slot(optimizer)
        site = probe.finder.from_frame(caller(2))
        event = probe.record(ScalerStep, site=site, scaler=slot, optimizer=opt_slot,
                             scale=_scale_value(self), enabled=bool(self.is_enabled()))
        before = probe.optimizer_step_count
        previous, probe._scaler_step_slot = probe._scaler_step_slot, slot
        probe.enter("scaler_step")
        try:
            return original(self, optimizer, *args, **kwargs)
        finally:
            probe.leave("scaler_step")
            probe._scaler_step_slot = previous
            probe.complete(event, skipped=probe.optimizer_step_count == before)
    return step


def _wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update(self: GradScaler, new_scale: Any = None) -> Any:
        probe = active()
        if probe is None:
            return original(self, new_scale)
        slot = probe.scaler_slot(self)
        before = _scale_value(self)
        event = probe.record(Update, scaler=slot, site=probe.finder.from_frame(caller(2)),
                             scale_before=before)
        try:
            result = original(self, new_scale)
        except Exception as exc:
            probe.complete(event, error=cut(safe_str(exc), MESSAGE_LIMIT))
            raise
        after = _scale_value(self)
        probe.scales_seen[slot] = (getattr(self, "_scale", None), after)
        probe.complete(event, scale_after=after)
        return result
    return update


def _wrap_scaler_load_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state_dict(self: GradScaler, state_dict: Any) -> Any:
        probe = active()
        if probe is not None:
            probe.scales_seen.pop(probe.scaler_slot(self), None)   # the scale is overwritten
        return original(self, state_dict)
    return load_state_dict


def install(patcher: Patcher) -> None:
    """Patch `torch.amp.GradScaler` so that an active probe sees its calls."""
    from torch.amp import grad_scaler

    scaler_cls = grad_scaler.GradScaler
    patcher.setattr(scaler_cls, "__init__", _wrap_scaler_init(scaler_cls.__init__))
    patcher.setattr(scaler_cls, "scale", _wrap_scale(scaler_cls.scale))
    patcher.setattr(scaler_cls, "unscale_", _wrap_unscale(scaler_cls.unscale_))
    patcher.setattr(scaler_cls, "step", _wrap_scaler_step(scaler_cls.step))
    patcher.setattr(scaler_cls, "update", _wrap_update(scaler_cls.update))
    patcher.setattr(scaler_cls, "get_scale", _wrap_get_scale(scaler_cls.get_scale))
    patcher.setattr(scaler_cls, "load_state_dict",
                    _wrap_scaler_load_state_dict(scaler_cls.load_state_dict))
