"""The `hf_trainer` and `lightning` spec keys: a training loop ampdoctor writes for the user.

With these keys the user gives no `train_loop`: ampdoctor builds, for every run, the
framework's own trainer from the spec (K, the micro-batch size, the optimizer steps, the
precision of the rung, `max_grad_norm`, the seed, in-order data, no logging or checkpoints)
plus the user's extra settings, and hands it the run's micro-batches in order. The loop it
returns has the `train_loop(model, optimizer, micro_batches, run)` signature, so every rung
runs it like any user loop; `__wrapped__` points at the user's callable, so a finding that
names "the loop" names the user's code.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from ..core import processes
from ..core.errors import InputError, SpecError
from ..spec import Spec
from .naming import spec_where, unusable

#: Lightning's precision flag for each rung.
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def _batch_len(batch: Any) -> int:
    """The number of samples in one micro-batch (its first tensor's leading dimension)."""
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch
    if isinstance(first, (tuple, list)):
        first = first[0]
    return int(first.shape[0])


def _rows(batches: list[Any]) -> list[Any]:
    """The micro-batches as dataset rows, in order: a dict batch gives dict rows, a tuple
    batch tuple rows (the Trainer's collator stacks them back into the same micro-batches)."""
    rows: list[Any] = []
    for batch in batches:
        for i in range(_batch_len(batch)):
            if isinstance(batch, Mapping):
                rows.append({k: v[i] for k, v in batch.items()})
            else:
                rows.append(tuple(part[i] for part in batch))
    return rows


class EntryPointRefused(InputError):
    """What an entry point the spec names returned cannot be used (exit 2, the key and its
    YAML line, with a record): raised inside the loop ampdoctor wrote, it is not the loop's
    error (`Session` lets it through)."""


def _check_keys(spec: Spec, key: str, given: Mapping[str, Any], known: set[str],
                what: str) -> None:
    """Every key of the spec's `key` mapping is one `what` takes (SpecError, exit 2, naming
    the key, its YAML line and the closest name), checked before any run."""
    import difflib
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise SpecError(f"{spec_where(spec, f'{key}.{name}')}spec key '{key}.{name}': "
                            f"{what} takes no argument '{name}'.{hint}")


def _refuse(spec: Spec, key: str, message: str) -> EntryPointRefused:
    return EntryPointRefused(f"{spec_where(spec, key)}spec key '{key}': {message}")


def _returned(value: Any) -> str:
    return "None (a missing `return`?)" if value is None else f"a {type(value).__name__}"


def hf_trainer_loop(spec: Spec, factory: Callable[..., Any]) -> Callable[..., Any]:
    """The loop of the `hf_trainer` key: `factory(model, args, train_dataset)` returns the
    user's Trainer, built per run with ampdoctor's TrainingArguments."""
    assert spec.hf_trainer is not None
    extra = dict(spec.hf_trainer.args)
    ref = spec.hf_trainer.factory
    from transformers import TrainingArguments
    _check_keys(spec, "hf_trainer.args", extra,
                {f.name for f in dataclasses.fields(TrainingArguments) if f.init},
                "transformers' TrainingArguments")

    deepspeed, config_files = _deepspeed_config(spec, extra.get("deepspeed"))

    @functools.wraps(factory)
    def train_loop(model: Any, optimizer: Any, micro_batches: Any, run: Any) -> None:
        from torch.utils.data import SequentialSampler
        from transformers import TrainingArguments

        batches = list(micro_batches)
        known = {f.name for f in dataclasses.fields(TrainingArguments)}
        with tempfile.TemporaryDirectory(prefix="ampdoctor-trainer-",
                                         dir=processes.temp_root()) as output_dir:
            settings: dict[str, Any] = {
                "output_dir": output_dir,
                "per_device_train_batch_size": _batch_len(batches[0]),
                "gradient_accumulation_steps": run.accumulation_steps,
                "max_steps": run.optimizer_steps,
                "fp16": run.precision == "fp16", "bf16": run.precision == "bf16",
                # the Trainer clips at 1.0 unless told: no max_grad_norm in the spec, no clip
                "max_grad_norm": run.max_grad_norm or 0.0,
                "seed": spec.seed, "report_to": "none", "save_strategy": "no",
                "logging_strategy": "no", "disable_tqdm": True,
                "use_cpu": run.device_type == "cpu", "dataloader_num_workers": 0,
                "train_sampling_strategy": "sequential",
            }
            settings = {k: v for k, v in settings.items() if k in known}
            settings.update(extra)
            if deepspeed is not None:
                settings["deepspeed"] = rung_precision(deepspeed, run.precision)
            try:
                args = TrainingArguments(**settings)
            except (TypeError, ValueError) as exc:
                refused = _refuse(spec, "hf_trainer.args", f"TrainingArguments refused them: "
                                  f"{exc}")
                raise refused from exc
            trainer = factory(model, args, _rows(batches))
            if not callable(getattr(trainer, "train", None)):
                raise _refuse(spec, "hf_trainer.factory", (
                    f"'{ref}' returned {_returned(trainer)}, not a "
                    "transformers Trainer: return the Trainer it builds (`return Trainer(model="
                    "model, args=args, train_dataset=train_dataset, ...)`)."))
            if "train_sampling_strategy" not in known:
                # a transformers without the option: the same in-order sampler, set on the
                # Trainer object ampdoctor was handed for this run
                trainer._get_train_sampler = (
                    lambda *a, **k: SequentialSampler(trainer.train_dataset))
            trainer.train()

    # the config file is on the diagnosed loop's path (the double-scaling rung's focus)
    train_loop.config_files = config_files  # type: ignore[attr-defined]
    return train_loop


def _deepspeed_config(spec: Spec, given: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """`hf_trainer.args.deepspeed`: the DeepSpeed config the Trainer hands its engine (a JSON
    file, relative to the spec, or the mapping), read once, and its file (in a list); None
    without one."""
    if given is None or given is False or given == "":
        return None, []
    _import_deepspeed(spec)
    if isinstance(given, Mapping):
        return dict(given), []
    import json
    path = (spec.spec_dir / str(given)).resolve()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _refuse(spec, "hf_trainer.args", f"deepspeed: cannot read {path} as a JSON "
                      f"DeepSpeed config: {exc}.") from exc
    if not isinstance(config, dict):
        raise _refuse(spec, "hf_trainer.args", f"deepspeed: {path} is not a JSON object.")
    return config, [str(path)]


def _import_deepspeed(spec: Spec) -> None:
    """DeepSpeed imported now, as the `deepspeed` key does: the Trainer imports it only when it
    builds the engine, and the probe patches the engine (and a group of one without MPI) of a
    DeepSpeed already imported when each run starts."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        raise SpecError(f"{spec_where(spec, 'hf_trainer.args')}spec key 'hf_trainer.args': "
                        "deepspeed is set but DeepSpeed is not installed here (pip install "
                        f"'ampdoctor[deepspeed]'): {exc}.") from exc


def rung_precision(config: Mapping[str, Any], precision: str) -> dict[str, Any]:
    """The config the rung's Trainer hands DeepSpeed: the user's, with `fp16.enabled` and
    `bf16.enabled` the rung's precision. ampdoctor sets the TrainingArguments' fp16/bf16 per
    rung; a config that pinned another precision would be refused by transformers (or
    accelerate) over ampdoctor's own setting, not the user's. The user's own TrainingArguments
    against the config are the double-scaling rung's (its search of `scan.paths`)."""
    built = copy.deepcopy(dict(config))
    for section in ("fp16", "bf16"):
        kept = built.get(section)
        built[section] = {**(kept if isinstance(kept, dict) else {}),
                          "enabled": precision == section}
    built.pop("bfloat16", None)   # (the old spelling of the bf16 section)
    return built


def _lightning() -> Any:
    try:
        import lightning
        return lightning
    except ImportError:
        import pytorch_lightning
        return pytorch_lightning


def lightning_loop(spec: Spec, module_factory: Callable[..., Any]) -> Callable[..., Any]:
    """The loop of the `lightning` key: a `Trainer(accumulate_grad_batches=K, ...)` per run
    fitting the LightningModule (the run's model) on an in-order DataLoader of the
    micro-batches, with the optimizers ampdoctor took from its `configure_optimizers`."""
    assert spec.lightning is not None
    extra = dict(spec.lightning.trainer)
    import inspect
    _check_keys(spec, "lightning.trainer", extra,
                set(inspect.signature(_lightning().Trainer.__init__).parameters) - {"self"},
                "lightning.Trainer")

    @functools.wraps(module_factory)
    def train_loop(model: Any, optimizer: Any, micro_batches: Any, run: Any) -> None:
        from torch.utils.data import DataLoader

        lightning = _lightning()
        batches = list(micro_batches)
        # the run's own optimizers (those ampdoctor built from configure_optimizers), so the
        # Trainer steps the objects the probe and the reference know
        model.configure_optimizers = lambda: optimizer
        with tempfile.TemporaryDirectory(prefix="ampdoctor-lightning-",
                                         dir=processes.temp_root()) as root:
            settings: dict[str, Any] = {
                "accelerator": "cpu" if run.device_type == "cpu" else "gpu", "devices": 1,
                "precision": LIGHTNING_PRECISION[run.precision],
                # one pass over the slice: a module that never steps ends, not loops forever
                "max_steps": run.optimizer_steps, "max_epochs": 1,
                "accumulate_grad_batches": run.accumulation_steps,
                "gradient_clip_val": run.max_grad_norm,
                "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                "enable_model_summary": False, "num_sanity_val_steps": 0,
                "default_root_dir": root,
            }
            if not getattr(model, "automatic_optimization", True):
                # manual optimization: Lightning refuses both; the module's training_step
                # accumulates (it must step every K = accumulation_steps batches) and clips
                settings.pop("gradient_clip_val")
                settings.pop("accumulate_grad_batches")
            settings.update(extra)
            trainer = lightning.Trainer(**settings)
            loader: Any = DataLoader(batches, batch_size=None, shuffle=False)  # type: ignore[arg-type]
            trainer.fit(model, loader)

    return train_loop


def check_lightning_module(spec: Spec, model: Any) -> None:
    """What `lightning.module` built is a LightningModule with optimizers to step (exit 2, the
    key and its YAML line, otherwise)."""
    assert spec.lightning is not None
    module = _lightning().LightningModule
    ref = spec.lightning.module
    if not isinstance(model, module):
        raise unusable(spec, "lightning.module", (
            f"'{ref}' returned a {type(model).__name__}, not a LightningModule: the `lightning` "
            "key fits a LightningModule with a Trainer (define `training_step` and "
            "`configure_optimizers` on it); a plain nn.Module goes under `model`, with a "
            "`train_loop`."))
    if spec.optimizer is None and type(model).configure_optimizers is module.configure_optimizers:
        raise unusable(spec, "lightning.module", (
            f"'{ref}' returned a {type(model).__name__}, which defines no "
            "`configure_optimizers`: Lightning has no optimizer to step. Define it (`return "
            "torch.optim.AdamW(self.parameters(), lr=...)`) or give the spec an `optimizer`."))
