"""A script's DeepSpeed engine, switched from outside in the child run (`child`): what
`deepspeed.initialize` builds is the engine of the run's precision, and for a reference the
engine of the fp32 full batch, without the user's config file being touched.

The config the script hands `deepspeed.initialize` (its `config=` mapping or path, or the
`--deepspeed_config` file of its `args`) is read and copied; the copy gets

- the run's precision: `bf16.enabled` / `fp16.enabled` as the rung forces it (fp32: both off);
- for a reference: ZeRO stage 0 and no `gradient_clipping` (the reference is the unclipped
  fp32 gradient of the whole window, which ZeRO's partitioning does not change on one rank),
  and unless the user gave --reference-args (`Job.deepspeed`), `gradient_accumulation_steps` 1
  and `train_micro_batch_size_per_gpu` K x b (`train_batch_size` dropped: DeepSpeed derives it);
- for clip-space (`Job.clip_at`): `gradient_clipping` at that threshold.

When the rung's precision is not the one the user's config asks for, the engine's floating
inputs are cast to the dtype the engine cast the module to (the script, written for its own
precision, cannot have done it), as DeepSpeed's own fp16 `auto_cast` does.

One process not started by a launcher gets what DeepSpeed reads to form a group of one
(`RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR`) before the script runs, so a script that reads
`LOCAL_RANK` itself finds it; `MASTER_PORT` when DeepSpeed initialises its group.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import sys
from dataclasses import replace
from typing import Any

import torch

from ..probe import patches
from ..probe.deepspeed import GROUP_OF_ONE
from ..probe.events import EngineBuilt

#: a rung's precision -> the config section that enables it
SECTIONS = {"bf16": "bf16", "fp16": "fp16"}


def asked_precision(config: dict[str, Any]) -> str:
    """The precision a DeepSpeed config asks for."""
    for key, precision in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return precision
    return "fp32"


def configured(config: dict[str, Any], precision: str, reference: bool,
               keys: dict[str, Any] | None, clip_at: float | None) -> dict[str, Any]:
    """A copy of the user's config with what the run decides (module docstring); `keys`: a
    reference's K and batch (none when the user gave --reference-args)."""
    built = copy.deepcopy(config)
    if "bfloat16" in built:   # (the old spelling of the bf16 section)
        built.setdefault("bf16", built.pop("bfloat16"))
    for section in SECTIONS.values():
        kept = built.get(section)
        built[section] = {**(kept if isinstance(kept, dict) else {}),
                          "enabled": precision == section}
    if keys is not None:
        built.pop("train_batch_size", None)
        built.update(keys)
    if reference:
        zero = built.get("zero_optimization")
        built["zero_optimization"] = {"stage": 0} if not isinstance(zero, dict) else {
            **{k: v for k, v in zero.items() if not k.startswith("offload")}, "stage": 0}
        built.pop("gradient_clipping", None)
    elif clip_at is not None:
        built["gradient_clipping"] = clip_at
    return built


def _user_config(bound: inspect.BoundArguments) -> tuple[Any, str | None]:
    """The config the call hands DeepSpeed (mapping or path) and where it came from."""
    for name in ("config", "config_params"):
        value = bound.arguments.get(name)
        if value is not None:
            return value, name
    args = bound.arguments.get("args")
    for name in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, name, None)
        if value is not None:
            return value, name
    return None, None


def single_process_environment() -> None:
    """What DeepSpeed reads to form a group of one, unless a launcher set it (module doc); the
    port is left to `probe.deepspeed`'s `init_distributed`, which picks a free one just before
    DeepSpeed binds it (picked at the script's start, another process could take it first)."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    for key, value in GROUP_OF_ONE.items():
        os.environ.setdefault(key, value)


def install(probe: Any, patcher: patches.Patcher) -> None:
    """Switch the engine `deepspeed.initialize` builds (module docstring), when the process
    imported DeepSpeed; `probe` is the child's `ScriptProbe`, told of each engine."""
    module = sys.modules.get("deepspeed")
    original = getattr(module, "initialize", None)
    if not callable(original):
        return
    single_process_environment()
    job = probe.job
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)   # DeepSpeed says what is wrong with the call
        config, where = _user_config(bound)
        if config is None:
            return original(*args, **kwargs)
        path = os.path.abspath(config) if isinstance(config, (str, os.PathLike)) else None
        mapping = _load(config)
        if mapping is None:
            return original(*args, **kwargs)
        asked = asked_precision(mapping)
        built = configured(mapping, job.precision, job.reference, job.deepspeed, job.clip_at)
        user_args = bound.arguments.get("args")
        saved = {}
        if where in ("deepspeed_config", "deepscale_config"):
            saved = {n: getattr(user_args, n) for n in ("deepspeed_config", "deepscale_config")
                     if hasattr(user_args, n)}
            for name in saved:
                setattr(user_args, name, None)
        bound.arguments.pop("config_params", None)
        bound.arguments["config"] = built
        seen = len(probe.probe.events)
        try:
            result = original(*bound.args, **bound.kwargs)
        finally:
            for name, value in saved.items():
                setattr(user_args, name, value)
        engine = result[0] if isinstance(result, tuple) and result else result
        _name_config_file(probe.probe, seen, path)
        probe.engine_built(engine)
        if asked != job.precision:
            engine.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
        return result

    patcher.setattr(module, "initialize", initialize)


def _load(config: Any) -> dict[str, Any] | None:
    if isinstance(config, dict):
        return config
    try:
        with open(config, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError, TypeError):
        return None   # DeepSpeed reads it (and says why it cannot)
    return loaded if isinstance(loaded, dict) else None


def _name_config_file(probe: Any, seen: int, path: str | None) -> None:
    """The engine's EngineBuilt names the user's config file (the engine was handed the
    rewritten copy), so a finding points at the user's key."""
    if path is None:
        return
    for index in range(seen, len(probe.events)):
        event = probe.events[index]
        if isinstance(event, EngineBuilt):
            probe.events[index] = replace(event, config_file=path)


def _cast_inputs(engine: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
    dtype = next((p.dtype for p in engine.module.parameters() if p.is_floating_point()), None)

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and dtype is not None:
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value

    return cast(args), cast(kwargs)

