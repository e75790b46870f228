"""The `deepspeed` spec key: the DeepSpeed loop ampdoctor writes for the user.

With it the user gives their DeepSpeed config (a JSON file or the mapping) instead of a
`train_loop`: for every run ampdoctor builds the engine with `deepspeed.initialize` from the
run's model (and its optimizer, unless the config names one) and that config, with the run's
K (`gradient_accumulation_steps`), micro-batch size, precision (`bf16`/`fp16` enabled or not,
the rest of those sections kept) and clipping (`gradient_clipping` = `max_grad_norm`) set from
the spec, and drives it the way DeepSpeed documents: on every micro-batch
`loss = loss(engine, micro_batch)`, `engine.backward(loss)`, `engine.step()`. The engine runs
the module in the precision it cast it to, so the micro-batch's floating tensors are handed in
that dtype. The loop's `__wrapped__` is the user's `loss`, so a finding that names "the loop"
names the user's code.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..core.errors import SpecError
from ..spec import Spec
from .naming import spec_where

#: The dtype the engine casts the module to, per rung.
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def read_config(spec: Spec) -> tuple[dict[str, Any], Path | None]:
    """The user's DeepSpeed config as a mapping, and its file (None for a mapping in the
    spec); a file that cannot be read, or one that contradicts the spec, is the spec's error."""
    assert spec.deepspeed is not None
    where = spec_where(spec, "deepspeed")
    source = spec.deepspeed.config
    path: Path | None = None
    if isinstance(source, str):
        path = (spec.spec_dir / source).resolve()
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise SpecError(f"{where}spec key 'deepspeed.config': cannot read {path}: "
                            f"{exc.strerror or exc}.") from exc
        except ValueError as exc:
            raise SpecError(f"{where}spec key 'deepspeed.config': {path} is not JSON: "
                            f"{exc}.") from exc
    else:
        config = copy.deepcopy(source)
    if not isinstance(config, dict):
        raise SpecError(f"{where}spec key 'deepspeed.config': the config must be a JSON object "
                        f"(a mapping), not {type(config).__name__}.")
    _agrees(spec, config, "gradient_accumulation_steps", spec.accumulation_steps,
            "accumulation_steps", where)
    _agrees(spec, config, "train_micro_batch_size_per_gpu", spec.micro_batch_size,
            "micro_batch_size", where)
    return config, path


def _agrees(spec: Spec, config: Mapping[str, Any], key: str, value: Any, spec_key: str,
            where: str) -> None:
    """A config that sets K (or the micro-batch) to another number than the spec: ampdoctor
    would triage a run the user's training does not make."""
    given = config.get(key)
    if isinstance(given, int) and not isinstance(given, bool) and value is not None \
            and given != value:
        raise SpecError(f"{where}spec key 'deepspeed.config' sets {key} = {given} but the "
                        f"spec's {spec_key} is {value}: ampdoctor builds every rung's engine "
                        f"with the spec's {spec_key}. Make them agree.")


def rung_config(config: Mapping[str, Any], run: Any) -> dict[str, Any]:
    """The user's config with what the spec and the rung decide."""
    built = copy.deepcopy(dict(config))
    built.pop("train_batch_size", None)   # DeepSpeed derives it: micro-batch x K x ranks
    built["gradient_accumulation_steps"] = run.accumulation_steps
    if run.micro_batch_size is not None:
        built["train_micro_batch_size_per_gpu"] = run.micro_batch_size
    for section, precision in (("fp16", "fp16"), ("bf16", "bf16")):
        kept = built.get(section)
        built[section] = {**(kept if isinstance(kept, dict) else {}),
                          "enabled": run.precision == precision}
    built.pop("bfloat16", None)   # (the old spelling of the bf16 section)
    if run.max_grad_norm:
        built["gradient_clipping"] = run.max_grad_norm
    else:
        built.pop("gradient_clipping", None)
    built.setdefault("steps_per_print", 1 << 30)
    return built


def _in_dtype(batch: Any, dtype: Any) -> Any:
    """The micro-batch with its floating tensors in the engine's dtype (integers as they are)."""
    import torch

    def cast(value: Any) -> Any:
        return (value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point()
                else value)

    if isinstance(batch, Mapping):
        return {k: cast(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cast(v) for v in batch)
    return cast(batch)


def deepspeed_loop(spec: Spec, loss: Callable[..., Any]) -> Callable[..., Any]:
    """The loop of the `deepspeed` key (see the module's docstring)."""
    config, path = read_config(spec)
    try:
        # imported now, so the probe patches its engine in every run (probe/deepspeed.py)
        import deepspeed  # noqa: F401
    except ImportError as exc:
        raise SpecError(f"{spec_where(spec, 'deepspeed')}spec key 'deepspeed': DeepSpeed is not "
                        "installed here (pip install 'ampdoctor[deepspeed]'): "
                        f"{exc}.") from exc

    @functools.wraps(loss)
    def train_loop(model: Any, optimizer: Any, micro_batches: Any, run: Any) -> None:
        import deepspeed
        import torch

        built = rung_config(config, run)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=None if "optimizer" in built else optimizer, config=built)
        dtype = getattr(torch, ENGINE_DTYPES[run.precision])
        for micro_batch in micro_batches:
            value = loss(engine, _in_dtype(micro_batch, dtype))
            if isinstance(value, tuple):   # (loss_sum, weight_sum): its mean
                value = value[0] / value[1]
            engine.backward(value)
            engine.step()

    # the config file is on the diagnosed loop's path (the double-scaling rung's focus)
    train_loop.config_files = [str(path)] if path is not None else []  # type: ignore[attr-defined]
    return train_loop
