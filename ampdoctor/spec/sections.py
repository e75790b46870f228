"""The spec's sections and value checks: the `module:function` references of the user's code,
the torch.optim name of an `optimizer` mapping (with its "did you mean"), and the nested
settings (`tolerances`, `scan`, `ddp`, `hf_trainer`, `lightning`, `deepspeed`) with the
framework settings ampdoctor sets per rung itself. `spec/__init__.py` builds the spec from them. No
torch here (a name missing from TORCH_OPTIMIZERS alone looks in torch.optim).
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from pydantic_core import PydanticCustomError

CALLABLE_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class CodeRef(str):
    """The `module:qualname` of a callable given in code (`Spec(model=make_model)`): shown in
    messages and sent to DDP ranks; the object itself is kept on the spec."""


#: The keys that name the user's code: a 'module:function' string, or (in code) the callable.
CODE_KEYS = ("model", "data", "loss", "optimizer", "train_loop")


def code_ref(fn: Any) -> CodeRef:
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) \
        or type(fn).__qualname__
    return CodeRef(f"{module}:{name}")


def _check_callable(value: str) -> str:
    if isinstance(value, CodeRef):
        return value
    if not CALLABLE_RE.match(value):
        raise ValueError(
            f"{value!r} is not a callable reference: write it as 'module.path:attribute' "
            "(for example 'train:train_loop')"
        )
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class Tolerance(_Strict):
    rtol: float | None = Field(default=None, ge=0)
    atol: float | None = Field(default=None, ge=0)


class ScanSettings(_Strict):
    paths: list[str] = Field(default_factory=list)


class DDPSettings(_Strict):
    world_size: StrictInt = Field(default=2, ge=1, le=64)
    #: the whole multi-process run of the ddp-sync rung, loading included (docs: spec keys)
    timeout_s: float = Field(default=300.0, gt=0, le=86400)
    #: deepspeed: the loop's own DeepSpeed engine does the communication (no wrapper of ours)
    wrapper: Literal["ddp", "fsdp", "hsdp", "deepspeed"] = "ddp"


#: The optimizer classes of torch.optim (torch 2.13), so that a spec validates without torch;
#: tests/test_spec.py checks it against the installed torch. A name missing here is looked up
#: in torch.optim itself before it is refused (a newer torch may have more).
TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax",
                    "LBFGS", "Muon", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")


def _torch_optimizers() -> tuple[str, ...]:
    """The optimizer classes of the installed torch.optim (TORCH_OPTIMIZERS without torch)."""
    try:
        import torch.optim as optim
    except ImportError:
        return TORCH_OPTIMIZERS
    return tuple(sorted(n for n, c in vars(optim).items()
                        if isinstance(c, type) and issubclass(c, optim.Optimizer)
                        and c is not optim.Optimizer))


def _check_optimizer_name(name: str) -> str:
    if name in TORCH_OPTIMIZERS:
        return name
    known = _torch_optimizers()   # imports torch only for a name the list does not hold
    if name in known:
        return name
    # a name that differs only in case ('Adamw') is that optimizer before any nearer spelling
    close = [k for k in known if k.lower() == name.lower()] \
        or difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else f" Optimizers: {', '.join(known)}."
    raise PydanticCustomError(
        "unknown_optimizer", "torch.optim has no optimizer {name}.{hint} (For another "
        "optimizer give a factory: optimizer: 'module:function')",
        {"name": repr(name), "hint": hint})


class OptimizerMapping(BaseModel):
    """`{name: SGD, lr: 0.05, ...}`: a torch.optim class and its keyword arguments."""

    model_config = ConfigDict(extra="allow")
    name: str

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_optimizer_name(value)


def fold_optimizer_errors(errors: list[Any]) -> list[Any]:
    """The `optimizer` union's branch errors as one problem: a misspelt class name alone when
    the mapping was meant; for a value that is neither form (a list, a number) one sentence
    naming both forms, not two about pydantic's branches ('a valid dictionary or instance of
    OptimizerMapping')."""
    if any(e["type"] == "unknown_optimizer" for e in errors):
        # the mapping was meant: that it is not also a 'module:function' string is noise
        return [e for e in errors if tuple(e["loc"][:2]) != ("optimizer", "str")]
    branches = [e for e in errors if len(e["loc"]) == 2 and e["loc"][0] == "optimizer"
                and e["type"] in ("string_type", "model_type")]
    if len(branches) < 2:
        return errors
    folded = {"type": "optimizer_form", "loc": ("optimizer",), "input": branches[0]["input"],
              "msg": "give a 'module:function' that returns the optimizer(s), or a mapping "
                     "naming a torch.optim class and its arguments ({name: SGD, lr: 0.05})"}
    at = errors.index(branches[0])   # after the unknown keys, which come first
    rest = [e for e in errors if e not in branches]
    return rest[:at] + [folded] + rest[at:]


#: TrainingArguments / lightning.Trainer settings ampdoctor sets per rung from the spec's own
#: keys: `args` / `trainer` may not set them (the spec key that does is named instead).
HF_RESERVED = {"gradient_accumulation_steps": "accumulation_steps",
               "per_device_train_batch_size": "micro_batch_size",
               "max_steps": "optimizer_steps", "fp16": "precisions", "bf16": "precisions",
               "max_grad_norm": "max_grad_norm", "seed": "seed", "output_dir": "(a temporary "
               "folder)", "train_sampling_strategy": "(in-order sampling)"}
LIGHTNING_RESERVED = {"accumulate_grad_batches": "accumulation_steps", "precision": "precisions",
                      "max_steps": "optimizer_steps", "gradient_clip_val": "max_grad_norm",
                      "devices": "device", "accelerator": "device",
                      "max_epochs": "optimizer_steps"}


def _no_reserved(value: dict[str, Any], reserved: dict[str, str]) -> dict[str, Any]:
    for key in value:
        if key in reserved:
            raise ValueError(f"{key!r} is set by ampdoctor for each rung from the spec key "
                             f"'{reserved[key]}': remove it here")
    return value


class HFTrainerSettings(_Strict):
    """`hf_trainer`: `factory(model, args, train_dataset)` returns the user's Trainer."""

    factory: str
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("factory")
    @classmethod
    def _factory(cls, value: str) -> str:
        return _check_callable(value)

    @field_validator("args")
    @classmethod
    def _args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _no_reserved(value, HF_RESERVED)


class LightningSettings(_Strict):
    """`lightning`: `module()` returns the LightningModule; `trainer` adds Trainer kwargs."""

    module: str
    trainer: dict[str, Any] = Field(default_factory=dict)

    @field_validator("module")
    @classmethod
    def _module(cls, value: str) -> str:
        return _check_callable(value)

    @field_validator("trainer")
    @classmethod
    def _trainer(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _no_reserved(value, LIGHTNING_RESERVED)


#: DeepSpeed config keys ampdoctor sets per rung from the spec's own keys (`deepspeed.config`
#: keeps the rest): the spec key that decides each.
DEEPSPEED_RESERVED = {"gradient_accumulation_steps": "accumulation_steps",
                      "train_micro_batch_size_per_gpu": "micro_batch_size",
                      "train_batch_size": "micro_batch_size x accumulation_steps x ranks",
                      "gradient_clipping": "max_grad_norm"}


class DeepSpeedSettings(_Strict):
    """`deepspeed`: the user's DeepSpeed config (a JSON file, relative to the spec, or the
    mapping itself); ampdoctor builds the engine of every rung from it."""

    config: str | dict[str, Any]
