"""DeepSpeed's engine, seen by the probe: what it was built to do, and what its optimizer consumes.

`engine.step()` updates only at its own accumulation boundary, and then its optimizer does not
read the module's `.grad`: under bf16/fp16 ZeRO-0 it steps flat fp32 master copies
(`FP16_Optimizer`, `BF16_Optimizer`), under ZeRO-1/2 this rank's flat fp32 partition
(`single_partition_of_fp32_groups[i]`, padded), under ZeRO-3 the partitioned flat buffer (one
shard of every parameter, concatenated). The engine unscales and clips that flat gradient just
before its inner (torch) optimizer steps it, so that is where the consumed gradient is read: at
the inner optimizer's step pre-hook, while `_take_model_step` runs, cut back into the module's
parameters by DeepSpeed's own offsets (its `_hp_mapping` fragments, ZeRO-3's `grad_position`),
shards of other ranks summed in. The weights the step starts from are read the same way (the
fp32 masters, not the module's bf16 copy).

Patched only when the process already imported DeepSpeed; nothing is imported here.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import recorder, wrappers
from .events import Clip, EngineBuilt, FrameworkPrecision, ZeroGrad
from .patches import Patcher

#: DeepSpeed's learning-rate schedules (`deepspeed.runtime.lr_schedules`), its config's
#: `scheduler.type`.
SCHEDULES = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

#: What DeepSpeed says when the accelerator has no kernels for a precision.
REFUSAL = "is not supported on your device"


@dataclass(frozen=True)
class Piece:
    """Where one stretch of a parameter lives in a flat fp32 tensor the inner optimizer steps:
    `numel` elements from `flat_start` of `flat` are the parameter's flattened elements from
    `start`."""

    name: str
    flat: torch.Tensor
    flat_start: int
    start: int
    numel: int


def _engine_precision(engine: Any) -> str:
    if engine.bfloat16_enabled():
        return "bf16"
    if engine.fp16_enabled():
        return "fp16"
    return "fp32"


def _lp_groups(optimizer: Any) -> list[list[torch.Tensor]] | None:
    for attr in ("bit16_groups", "bf16_groups", "fp16_groups"):
        groups = getattr(optimizer, attr, None)
        if groups:
            return list(groups)
    return None


def _zero3_pieces(optimizer: Any, names: dict[int, str]) -> list[Piece]:
    """ZeRO-3: each parameter's shard of `partition_numel()` elements in the partitioned flat
    buffer (`grad_position`), rank r holding elements [r * partition_numel, ...) of the
    flattened parameter (the last shard padded)."""
    rank = _dp_rank(optimizer)
    pieces: list[Piece] = []
    for group_idx, group in enumerate(optimizer.fp16_groups):
        for param in group:
            _, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
            start = rank * param.partition_numel()
            real = max(0, min(numel, int(param.ds_numel) - start))
            if real and id(param) in names:
                pieces.append(Piece(names[id(param)],
                                    optimizer.fp32_partitioned_groups_flat[group_idx],
                                    offset, start, real))
    return pieces


def _fragment_pieces(flats: list[torch.Tensor], groups: list[list[torch.Tensor]],
                     names: dict[int, str]) -> list[Piece]:
    """ZeRO-1/2 and BF16_Optimizer: DeepSpeed's own fragment map of each parameter
    (`_hp_mapping`) into this rank's flat fp32 partition of its group."""
    pieces: list[Piece] = []
    for group in groups:
        for param in group:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None or id(param) not in names:
                continue   # (no element of it in this rank's partition)
            pieces.append(Piece(names[id(param)], flats[mapping.param_group_index],
                                mapping.hp_fragment_address.start,
                                mapping.lp_fragment_address.start,
                                mapping.lp_fragment_address.numel))
    return pieces


def _copy_pieces(groups: list[list[torch.Tensor]], copies: list[Any], flat: bool,
                 names: dict[int, str]) -> list[Piece]:
    """FP16_Optimizer (`flat`: each group flattened whole, in order) and FP16_UnfusedOptimizer
    (an fp32 copy of each parameter), the bf16/fp16 ZeRO-0 wrappers."""
    pieces: list[Piece] = []
    for group, copy in zip(groups, copies, strict=True):
        offset = 0
        for index, param in enumerate(group):
            if id(param) in names:
                pieces.append(Piece(names[id(param)], copy, offset, 0, param.numel()) if flat
                              else Piece(names[id(param)], copy[index], 0, 0, param.numel()))
            offset += param.numel()
    return pieces


def layout(engine: Any, model: torch.nn.Module) -> list[Piece]:
    """Every trainable parameter's pieces in the fp32 tensors the engine's inner optimizer
    steps (this rank's, under a partitioned ZeRO stage), named as in `model` (the run's own
    model, which the loop may have wrapped before handing it to DeepSpeed)."""
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = engine.optimizer
    if hasattr(optimizer, "grad_position") and hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return _zero3_pieces(optimizer, names)
    groups = _lp_groups(optimizer)
    flats = (getattr(optimizer, "single_partition_of_fp32_groups", None)
             or getattr(optimizer, "fp32_groups_flat_partition", None))
    if groups is not None and flats is not None:
        return _fragment_pieces(flats, groups, names)
    if groups is not None and getattr(optimizer, "fp32_groups_flat", None) is not None:
        return _copy_pieces(groups, optimizer.fp32_groups_flat, True, names)
    if groups is not None and getattr(optimizer, "fp32_groups", None) is not None:
        return _copy_pieces(groups, optimizer.fp32_groups, False, names)
    # fp32 at ZeRO-0: the inner optimizer steps the module's parameters themselves
    return [Piece(name, param, 0, 0, param.numel())
            for name, param in model.named_parameters() if param.requires_grad]


def _dp_rank(optimizer: Any) -> int:
    group = getattr(optimizer, "dp_process_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group)
    return 0


def _partitioned(engine: Any) -> bool:
    return (engine.zero_optimization_stage() > 0 and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


@dataclass
class _EngineStep:
    """One `_take_model_step` of an engine: the pieces read at each inner step pre-hook, until
    every parameter is complete (ZeRO-1/2 step each parameter group on its own)."""

    engine: Any
    model: torch.nn.Module
    pieces: list[Piece]
    inner: Any
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    emitted: bool = False

    def __post_init__(self) -> None:
        #: each trainable parameter's whole number of elements (a ZeRO-3 one's `ds_numel`)
        #: and shape, by name
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.numels = {n: int(getattr(p, "ds_numel", p.numel())) for n, p in params}
        self.shapes = {n: getattr(p, "ds_shape", p.shape) for n, p in params}

    def observe(self, optimizer: Any) -> bool:
        """The inner optimizer's step pre-hook: read its flats' pieces; True (the engine's
        step is recorded here, not as a plain optimizer step)."""
        if optimizer is not self.inner:
            return False
        probe = recorder.ACTIVE
        stepping = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for piece in self.pieces:
            if id(piece.flat) not in stepping or id(piece) in self.seen:
                continue
            self.seen.add(id(piece))
            weight = self.weights.setdefault(piece.name, torch.zeros(self.numels[piece.name]))
            grad = self.grads.setdefault(piece.name, torch.zeros(self.numels[piece.name]))
            flat = piece.flat.detach().reshape(-1)
            weight[piece.start:piece.start + piece.numel] = (
                flat[piece.flat_start:piece.flat_start + piece.numel].float().cpu())
            if piece.flat.grad is not None:
                flat_grad = piece.flat.grad.detach().reshape(-1)
                grad[piece.start:piece.start + piece.numel] = (
                    flat_grad[piece.flat_start:piece.flat_start + piece.numel].float().cpu())
        if probe is not None and len(self.seen) == len(self.pieces):
            self.emit(probe)
        return True

    def emit(self, probe: recorder.Probe) -> None:
        if self.emitted or not self.seen:
            return
        self.emitted = True
        if _partitioned(self.engine):
            # each rank read its own shards: the whole is their sum (zeros elsewhere), summed
            # in one collective over every parameter in the module's order, the same on
            # every rank whatever its partition holds
            names = list(self.numels)
            for name in names:
                self.weights.setdefault(name, torch.zeros(self.numels[name]))
                self.grads.setdefault(name, torch.zeros(self.numels[name]))
            parts = [self.weights[n] for n in names] + [self.grads[n] for n in names]
            whole = torch.cat(parts)
            torch.distributed.all_reduce(whole)
            for part, summed in zip(parts, whole.split([p.numel() for p in parts]),
                                    strict=True):
                part.copy_(summed)
        state = {k: v.detach().float().cpu() for k, v in self.model.state_dict().items()}
        grads: dict[str, torch.Tensor | None] = {}
        for name, flat in self.grads.items():
            grads[name] = flat.reshape(self.shapes[name])
            state[name] = self.weights[name].reshape(self.shapes[name])
        probe.on_optimizer_step(self.inner, recorder.Consumed(grads, state))


def load_weights(engine: Any, model: torch.nn.Module, state: Any) -> None:
    """Set the weights the engine's optimizer steps to `state` (by name, as in `model`): its
    fp32 masters or this rank's partition of them (`layout`), and under ZeRO-3 the module's own
    shards (`ds_tensor`), which a `load_state_dict` of the partitioned module cannot reach. A
    teacher-forced run's weights loaded into the module alone would be overwritten from the
    masters at the engine's next step."""
    with torch.no_grad():
        for piece in layout(engine, model):
            value = state.get(piece.name)
            if value is not None:
                flat = piece.flat.data.view(-1)
                flat[piece.flat_start:piece.flat_start + piece.numel].copy_(
                    value.reshape(-1)[piece.start:piece.start + piece.numel])
        rank = _dp_rank(engine.optimizer)
        for name, param in model.named_parameters():
            shard: Any = getattr(param, "ds_tensor", None)
            value = state.get(name)
            if shard is None or value is None:
                continue
            zero3: Any = param   # (DeepSpeed's partitioned parameter)
            start = rank * zero3.partition_numel()
            real = max(0, min(shard.numel(), int(zero3.ds_numel) - start))
            shard.data.view(-1)[:real].copy_(value.reshape(-1)[start:start + real])


def _clip(engine: Any, probe: recorder.Probe) -> None:
    """The engine clips the consumed gradient at the config's `gradient_clipping` (global L2
    norm, in true-gradient space): a clip of every parameter, for the reference to mirror."""
    max_norm = float(engine.gradient_clipping() or 0.0)
    if max_norm > 0:
        params = tuple(id(p) for p in engine.module.parameters() if p.requires_grad)
        probe.record(Clip, site=probe.finder.from_frame(sys._getframe(2)), clip_kind="norm",
                     max_norm=max_norm, norm_type=2.0, param_ids=params)


def _wrap_take_model_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _take_model_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = recorder.ACTIVE
        inner = getattr(self, "basic_optimizer", None)
        if probe is None or inner is None:
            return original(self, *args, **kwargs)
        model = probe.model if probe.model is not None else self.module
        step = _EngineStep(self, model, layout(self, model), inner)
        _clip(self, probe)
        previous, probe.framework_step = probe.framework_step, step.observe
        probe.enter("zero_grad")   # the engine's own zero_grad after its update
        try:
            result = original(self, *args, **kwargs)
        finally:
            probe.leave("zero_grad")
            probe.framework_step = previous
        step.emit(probe)
        return result
    return _take_model_step


def _wrap_zero_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = recorder.ACTIVE
        if probe is not None and not probe.inside("zero_grad"):
            # `engine.zero_grad()` sets each `param.grad = None` itself: no torch zero_grad runs
            probe.record(ZeroGrad, site=probe.finder.from_frame(sys._getframe(1)),
                         owner="module")
        return original(self, *args, **kwargs)
    return zero_grad


def _wrap_engine_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        probe = recorder.ACTIVE
        previous = None
        if probe is not None:
            # DeepSpeed's optimizer wrappers step once with zero gradients to build the inner
            # optimizer's state: not a step of the loop
            previous, probe.framework_step = probe.framework_step, lambda optimizer: True
        try:
            original(self, *args, **kwargs)
        except ValueError as exc:
            text = str(exc)
            if probe is not None and REFUSAL in text:
                asked = "fp16" if "fp16" in text else "bf16" if "bf16" in text else "?"
                probe.record(FrameworkPrecision, site=probe.finder.from_frame(sys._getframe(1)),
                             framework="DeepSpeed", asked=asked, ran=None, refused=True,
                             reason=f"DeepSpeed refuses {asked} on this device ({text.strip()})")
            raise
        finally:
            if probe is not None:
                probe.framework_step = previous
        if probe is not None:
            _built(self, probe, kwargs.get("config") or kwargs.get("config_params"))
    return __init__


def _built(engine: Any, probe: recorder.Probe, config: Any) -> None:
    site = probe.finder.from_frame(sys._getframe(2))
    precision = _engine_precision(engine)
    inner = getattr(engine, "basic_optimizer", None)
    scheduler = getattr(engine, "lr_scheduler", None)
    if inner is not None and engine.optimizer is not inner:
        probe.alias_optimizer(engine.optimizer, inner)
    probe.record(EngineBuilt, site=site, zero_stage=int(engine.zero_optimization_stage()),
                 precision=precision,
                 fp32_master=precision != "fp32" and inner is not None
                 and engine.optimizer is not inner,
                 accumulation_steps=int(engine.gradient_accumulation_steps()),
                 clipping=float(engine.gradient_clipping() or 0.0),
                 optimizer=type(inner).__name__ if inner is not None else "",
                 scheduler=type(scheduler).__name__ if scheduler is not None else "",
                 config_file=os.path.abspath(config) if isinstance(config, (str, os.PathLike))
                 else None, **_loss_scale(engine, precision))
    probe.record(FrameworkPrecision, site=site, framework="DeepSpeed", asked=precision,
                 ran=precision)


def _loss_scale(engine: Any, precision: str) -> dict[str, Any]:
    """The fp16 engine's starting loss scale and the config key that sets it."""
    if precision != "fp16":
        return {}
    optimizer = engine.optimizer
    scale: Any = getattr(optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(optimizer, "loss_scale", None)
    try:
        value = float(scale)
    except (TypeError, ValueError):
        return {}
    static = float(getattr(engine, "loss_scale", lambda: 0)() or 0)
    return {"loss_scale": value,
            "loss_scale_key": "fp16.loss_scale" if static else "fp16.initial_scale_power"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: What DeepSpeed (and torch.distributed's env:// rendezvous) reads to join a process group of
#: one without a launcher or MPI; MASTER_PORT is a free port picked when the group forms.
GROUP_OF_ONE = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


def _wrap_init_distributed(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_distributed(*args: Any, **kwargs: Any) -> Any:
        if recorder.ACTIVE is not None and torch.distributed.is_initialized():
            # ampdoctor's own ranks (ddp.wrapper: deepspeed) joined their group without a
            # launcher: DeepSpeed reads where it is from the environment
            rank = str(torch.distributed.get_rank())
            for key, value in (("RANK", rank), ("LOCAL_RANK", rank),
                               ("WORLD_SIZE", str(torch.distributed.get_world_size()))):
                os.environ.setdefault(key, value)
        elif recorder.ACTIVE is not None:
            # one process, not launched by `deepspeed`/torchrun: without these DeepSpeed looks
            # for MPI (script mode set all but the port before the script ran)
            group_of_one()
        return original(*args, **kwargs)
    return init_distributed


def group_of_one() -> None:
    """What DeepSpeed (and accelerate, which otherwise takes port 29500 for everyone) reads to
    form a process group of one, with a free port, unless a launcher set a world or a port."""
    if "MASTER_PORT" in os.environ or os.environ.get("WORLD_SIZE", "1") != "1":
        return
    for key, value in {**GROUP_OF_ONE, "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(key, value)


def install(patcher: Patcher) -> None:
    """Patch DeepSpeed's engine when the process imported it."""
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    engine = getattr(engine_module, "DeepSpeedEngine", None)
    if not isinstance(engine, type):
        return
    patcher.setattr(engine, "__init__", _wrap_engine_init(vars(engine)["__init__"]))
    patcher.setattr(engine, "zero_grad", _wrap_zero_grad(vars(engine)["zero_grad"]))
    patcher.setattr(engine, "_take_model_step",
                    _wrap_take_model_step(vars(engine)["_take_model_step"]))
    schedules = sys.modules.get("deepspeed.runtime.lr_schedules")
    for name in SCHEDULES:
        cls = getattr(schedules, name, None)
        if isinstance(cls, type) and "step" in vars(cls):
            # DeepSpeed's own schedules are not torch LRSchedulers: seen the same way
            patcher.setattr(cls, "step", wrappers.wrap_scheduler_step(vars(cls)["step"]))
    comm = sys.modules.get("deepspeed.comm")
    original = getattr(comm, "init_distributed", None)
    if callable(original):
        patcher.setattr(comm, "init_distributed", _wrap_init_distributed(original))
