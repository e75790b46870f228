"""The switches a child run puts over the probe's own patches (`child`): every autocast the
script builds forced to the run's precision, every GradScaler forced off or on, the modules and
optimizers it builds seen (to find the model), `torch.compile` eager, a process group formed
from a launcher's environment that is not there formed as a group of one, and, for clip-space,
every norm clip at a given threshold; for a reference, the gradient kept before any clip or step
touches it."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..probe import patches
from ..probe.callsite import CallSiteFinder


class ScriptProbe(Protocol):
    """What the switches use of a child run's probe (`child.ScriptProbe`, which imports this
    module: a protocol, not an import back)."""

    @property
    def job(self) -> Any: ...
    @property
    def finder(self) -> CallSiteFinder: ...
    @property
    def out(self) -> Any: ...
    def module_built(self, module: torch.nn.Module) -> None: ...
    def optimizer_built(self, optimizer: torch.optim.Optimizer) -> None: ...
    def keep_reference(self) -> None: ...

#: autocast dtype per forced precision (None: autocast disabled)
FORCED_DTYPE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def install(probe: ScriptProbe, patcher: patches.Patcher) -> None:
    """The switches of module docstring, patched over the probe's own wrappers."""
    from torch.amp import autocast_mode, grad_scaler

    _eager(probe, patcher)
    _group_of_one(probe, patcher)
    job = probe.job
    dtype = FORCED_DTYPE[job.precision]
    autocast_init = autocast_mode.autocast.__init__

    @functools.wraps(autocast_init)
    def autocast(self: Any, device_type: Any, *args: Any, **kwargs: Any) -> None:
        bound = dict(zip(("dtype", "enabled", "cache_enabled"), args, strict=False))
        bound.update(kwargs)
        asked = bound.get("dtype")
        probe.out.autocasts.append({
            "device": str(device_type),
            "dtype": None if asked is None else str(asked).replace("torch.", ""),
            "enabled": bool(bound.get("enabled", True)),
            "site": probe.finder.from_frame(sys._getframe(1))})
        if dtype is None:
            bound["enabled"] = False
        else:
            bound.update(dtype=dtype, enabled=True)
        return autocast_init(self, device_type, **bound)

    patcher.setattr(autocast_mode.autocast, "__init__", autocast)

    scaler_init = grad_scaler.GradScaler.__init__

    @functools.wraps(scaler_init)
    def scaler(self: Any, *args: Any, **kwargs: Any) -> None:
        names = ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval",
                 "enabled")
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        init_scale = bound.get("init_scale", 2.0**16)
        probe.out.scalers.append({"enabled": bool(bound.get("enabled", True)),
                                  "device": str(bound.get("device", "cuda")),
                                  "init_scale": (float(init_scale)
                                                 if isinstance(init_scale, (int, float))
                                                 else None),
                                  "site": probe.finder.from_frame(sys._getframe(1))})
        bound["enabled"] = job.precision == "fp16"
        return scaler_init(self, **bound)

    patcher.setattr(grad_scaler.GradScaler, "__init__", scaler)

    module_init = torch.nn.Module.__init__

    @functools.wraps(module_init)
    def module(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        module_init(self, *args, **kwargs)
        probe.module_built(self)

    patcher.setattr(torch.nn.Module, "__init__", module)

    optimizer_init = torch.optim.Optimizer.__init__

    @functools.wraps(optimizer_init)
    def optimizer(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        optimizer_init(self, *args, **kwargs)
        probe.optimizer_built(self)

    patcher.setattr(torch.optim.Optimizer, "__init__", optimizer)

    if job.clip_at is not None:
        import torch.nn.utils as nn_utils
        from torch.nn.utils import clip_grad
        for name in ("clip_grad_norm_", "clip_grad_norm", "clip_grads_with_norm_"):
            for owner in (clip_grad, nn_utils):
                original = getattr(owner, name, None)
                if original is not None:
                    patcher.setattr(owner, name, _threshold(original, job.clip_at))
    if job.reference:
        import torch.nn.utils as nn_utils
        from torch.nn.utils import clip_grad
        for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm",
                     "clip_grads_with_norm_"):
            for owner in (clip_grad, nn_utils):
                original = getattr(owner, name, None)
                if original is not None:
                    patcher.setattr(owner, name, _before(original, probe.keep_reference))
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        patcher.add_handle(register_optimizer_step_pre_hook(_keep_at_step(probe)))


def _keep_at_step(probe: Any) -> Callable[..., Any]:
    """An optimizer step pre-hook that keeps the reference's gradient: now, or, for a step
    handed a closure (Lightning's automatic optimization runs the window's backward inside
    the step), once the closure has run (a clip inside it has kept it first, unclipped)."""
    def hook(_optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            probe.keep_reference()
            return None

        def closure_then_keep() -> Any:
            result = closure()
            probe.keep_reference()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_keep}
        return (closure_then_keep, *args[1:]), kwargs
    return hook


def _threshold(original: Callable[..., Any], max_norm: float) -> Callable[..., Any]:
    """A norm clip that clips at `max_norm`, whatever threshold the script passes."""
    @functools.wraps(original)
    def wrapper(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (max_norm, *args[1:])
        else:
            kwargs["max_norm"] = max_norm
        return original(parameters, *args, **kwargs)
    return wrapper


def _before(original: Callable[..., Any], call: Callable[[], object]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        call()
        return original(*args, **kwargs)
    return wrapper


def _eager(probe: ScriptProbe, patcher: patches.Patcher) -> None:
    """`torch.compile` (and `Module.compile`) leave the model eager in a run: the updates an
    accumulation or precision mistake changes are the same, and each of a diagnose's ~10 runs is
    a new process that would compile anew (minutes on a CPU). Where it was called is noted
    (`Outcome.compiled`) for the record."""
    import torch._dynamo

    real = torch.compile

    @functools.wraps(real)
    def compile(*args: Any, **kwargs: Any) -> Any:
        site = probe.finder.from_frame(sys._getframe(1))
        if site is not None:
            probe.out.compiled.append(f"{site.file}:{site.line}")
        return real(*args, **kwargs)

    patcher.setattr(torch, "compile", compile)
    patcher.setattr(torch._dynamo.config, "disable", True)


def _group_of_one(probe: ScriptProbe, patcher: patches.Patcher) -> None:
    """A script written for a launcher (`dist.init_process_group("gloo")`, the rendezvous read
    from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) run without one: each run forms a group of
    one on a free port, as `torchrun --nproc_per_node 1` would, instead of failing on the
    missing variables (script mode runs the script in one process). Only where the call would
    read them: an `init_method` or a `store` of the script's own, or a launcher's RANK, are left
    as they are. The call's line is noted (`Outcome.group_of_one`) for the record."""
    import os

    import torch.distributed as dist

    real = getattr(dist, "init_process_group", None)
    if real is None:
        return

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
        size = kwargs.get("world_size", args[3] if len(args) > 3 else -1)
        if (method in (None, "env://") and kwargs.get("store") is None
                and len(args) <= 5 and size in (-1, 1)
                and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ):
            from ..probe.deepspeed import GROUP_OF_ONE, free_port
            # (LOCAL_WORLD_SIZE as `torchrun --nproc_per_node 1` sets it too)
            for key, value in {**GROUP_OF_ONE, "LOCAL_WORLD_SIZE": "1"}.items():
                os.environ.setdefault(key, value)
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            site = probe.finder.from_frame(sys._getframe(1))
            probe.out.group_of_one.append(f"{site.file}:{site.line}" if site is not None
                                          else "torch.distributed.init_process_group")
        return real(*args, **kwargs)

    patcher.setattr(dist, "init_process_group", init_process_group)
