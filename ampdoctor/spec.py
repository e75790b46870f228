"""The spec (CONTRACT §1): a pydantic model of every key, and YAML loading with line numbers.

pydantic does the type checking and defaults; this module turns its errors into one paragraph
per problem that names the key and the YAML line, and suggests the nearest key for a typo.
No torch here: validation must be fast and usable without it.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .errors import SpecError
from .spec_yaml import read_spec_yaml, top_level_lines

CALLABLE_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
PRECISIONS = ("fp32", "bf16", "fp16")
Precision = Literal["fp32", "bf16", "fp16"]


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


def _every_precision() -> list[Precision]:
    return ["fp32", "bf16", "fp16"]


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
    wrapper: Literal["ddp", "fsdp", "hsdp"] = "ddp"


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


class Spec(_Strict):
    name: str | None = None
    project_root: str | None = None
    #: the model factory; not needed with `lightning` (the LightningModule is the model)
    model: str | None = None
    data: str
    loss: str | None = None
    optimizer: str | OptimizerMapping | None = None
    #: exactly one of train_loop, hf_trainer, lightning says what runs the training
    train_loop: str | None = None
    hf_trainer: HFTrainerSettings | None = None
    lightning: LightningSettings | None = None
    accumulation_steps: StrictInt = Field(ge=1, le=1_000_000)
    micro_batch_size: StrictInt | None = Field(default=None, ge=1)
    optimizer_steps: StrictInt = Field(default=3, ge=1, le=1_000_000)
    max_grad_norm: float | None = Field(default=None, gt=0)
    device: str = "auto"
    #: torch.manual_seed takes any 64-bit value; 2**32 - 1 keeps numpy's seeding valid too
    seed: StrictInt = Field(default=0, ge=0, le=2**32 - 1)
    scan: ScanSettings | None = None
    tolerances: dict[Precision, Tolerance] = Field(default_factory=dict)
    ddp: DDPSettings | None = None
    #: align: every forward of micro-batch i runs under the same RNG state in every run of the
    #: loop and in the reference, so dropout masks match; off: functional dropout runs at p = 0.
    dropout: Literal["align", "off"] = "align"
    #: the precisions the user's training uses; rungs of the others are skipped
    precisions: list[Precision] = Field(default_factory=_every_precision, min_length=1)
    #: the longest one rung may run the loop before ampdoctor stops it (exit 3 naming the rung
    #: and where the loop was); the ddp-sync rung is bounded by ddp.timeout_s instead
    timeout_s: float = Field(default=600.0, gt=0, le=7 * 86400)

    #: the rungs to run (default: all); the others are reported as skipped
    rungs: list[str] | None = Field(default=None, min_length=1)

    # Filled in by load_spec, not by the user.
    spec_path: Path | None = Field(default=None, exclude=True)
    #: callables given in code, by key (their `CodeRef` is the key's value)
    _callables: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _code_objects(cls, data: Any, handler: Any) -> Any:
        """`Spec(train_loop=my_loop)`: a callable stands for its 'module:function' reference
        and is kept as it is (no import needed)."""
        found: dict[str, Any] = {}
        if isinstance(data, dict):
            data = dict(data)
            for key in CODE_KEYS:
                value = data.get(key)
                if value is not None and not isinstance(value, (str, dict)) and callable(value):
                    found[key] = value
                    data[key] = code_ref(value)
        spec = handler(data)
        if found:
            spec._callables.update(found)
        return spec

    @model_validator(mode="after")
    def _one_entry_point(self) -> Spec:
        given = [k for k in ("train_loop", "hf_trainer", "lightning") if getattr(self, k)]
        choice = ("'train_loop' (your loop), 'hf_trainer' (a transformers Trainer factory) "
                  "or 'lightning' (a LightningModule factory)")
        if not given:
            raise ValueError(f"spec key 'train_loop' is missing: give exactly one of {choice}")
        if len(given) > 1:
            raise ValueError(f"give exactly one of {choice}; this spec gives "
                             f"{' and '.join(given)}")
        if self.model is None and self.lightning is None:
            raise ValueError("spec key 'model' is missing: a 'module:function' that returns "
                             "the torch.nn.Module to train")
        return self

    @field_validator("rungs")
    @classmethod
    def _rung_ids(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        from .findings import RUNG_IDS
        for rung in value:
            if rung not in RUNG_IDS:
                close = difflib.get_close_matches(rung, RUNG_IDS, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"{rung!r} is not a rung.{hint} Rungs: {', '.join(RUNG_IDS)}")
        return [r for r in RUNG_IDS if r in value]

    def callable_for(self, key: str) -> Any | None:
        """The object given in code for `key`, or None when the key is a reference string."""
        return self._callables.get(key)

    def with_overrides(self, **overrides: Any) -> Spec:
        """This spec with some keys replaced (the CLI's --steps, --device, ...), validated
        again; SpecError naming the key when a value is not valid."""
        if not overrides:
            return self
        data = self.model_dump(exclude={"spec_path"}, exclude_unset=True)
        data.update(self._callables)
        data.update(overrides)
        try:
            spec = Spec.model_validate(data)
        except ValidationError as exc:
            raise SpecError("\n".join(validation_messages(
                exc, Path("override"), {})), cause=exc) from exc
        spec.spec_path = self.spec_path
        return spec

    @field_validator("model", "data", "train_loop", "loss", mode="before")
    @classmethod
    def _callable(cls, value: Any) -> Any:
        return _check_callable(value) if isinstance(value, str) else value

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _check_callable(value)
        return value

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("a precision is listed twice")
        # fp32 always runs: it is what every other precision is compared with
        return ["fp32"] + [p for p in ("bf16", "fp16") if p in value]

    @field_validator("dropout", mode="before")
    @classmethod
    def _dropout(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false
        return "off" if value is False else value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not DEVICE_RE.match(value):
            raise ValueError(f"{value!r} is not a device: use auto, cpu, cuda or cuda:N")
        return value

    # --- derived paths -----------------------------------------------------------------
    @property
    def spec_dir(self) -> Path:
        return self.spec_path.parent if self.spec_path else Path.cwd()

    @property
    def root(self) -> Path:
        """The folder put first on sys.path: `project_root` relative to the spec."""
        if self.project_root is None:
            return self.spec_dir.resolve()
        return (self.spec_dir / self.project_root).resolve()

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        return self.spec_path.stem if self.spec_path else "spec"

    def scan_paths(self) -> list[Path]:
        if self.scan and self.scan.paths:
            return [(self.spec_dir / p).resolve() for p in self.scan.paths]
        return [self.root]


def _describe_location(loc: tuple[Any, ...], lines: dict[str, int]) -> tuple[str, int | None]:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    # pydantic puts the union branch name ('str', 'OptimizerMapping') in the location.
    parts = [p for p in parts
             if p not in {"str", "OptimizerMapping",
                          "function-after[_optimizer(), union[str,OptimizerMapping]]"}
             and not p.startswith("function-")]
    key = ".".join(parts) if parts else "(spec)"
    line = None
    for n in range(len(parts), 0, -1):
        line = lines.get(".".join(parts[:n]))
        if line is not None:
            break
    return key, line


def _paragraph(path: Path, key: str, line: int | None, what: str) -> str:
    where = f"{path}:{line}" if line else str(path)
    return f"{where}: spec key '{key}': {what}"


#: Top-level keys beyond this are not worth a "did you mean" each.
MAX_SPEC_KEYS = 200
#: Problems listed in a spec error; the rest are counted.
MAX_SPEC_ERRORS = 20


def validation_messages(exc: ValidationError, path: Path, lines: dict[str, int]) -> list[str]:
    """One sentence per problem, each naming the key and the line (at most MAX_SPEC_ERRORS;
    the rest are counted in a last line)."""
    messages: list[str] = []
    seen: set[str] = set()
    known = list(Spec.model_fields.keys())
    known.remove("spec_path")
    # Unknown keys first: a typo'd key is usually also the "missing" one.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    if any(e["type"] == "unknown_optimizer" for e in errors):
        # the mapping was meant: that it is not also a 'module:function' string is noise
        errors = [e for e in errors if tuple(e["loc"][:2]) != ("optimizer", "str")]
    for err in errors:
        key, line = _describe_location(err["loc"], lines)
        kind = err["type"]
        if kind == "extra_forbidden":
            leaf = key.split(".")[-1]
            pool = known if "." not in key else _nested_keys(key)
            close = difflib.get_close_matches(leaf, pool, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(pool)}."
            text = f"unknown key.{hint}"
        elif kind == "missing":
            text = "is required but missing."
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            got = err.get("input")
            shown = "" if isinstance(got, dict) or kind == "unknown_optimizer" \
                else f" (got {got!r})"
            text = f"{msg}{shown}."
        paragraph = _paragraph(path, key, line, text)
        if paragraph not in seen:
            seen.add(paragraph)
            messages.append(paragraph)
    if len(messages) > MAX_SPEC_ERRORS:
        more = len(messages) - MAX_SPEC_ERRORS
        messages = messages[:MAX_SPEC_ERRORS] + [f"... and {more:,} more problem(s)."]
    return messages


def _nested_keys(key: str) -> list[str]:
    head = key.split(".")[0]
    nested: dict[str, type[BaseModel]] = {"scan": ScanSettings, "ddp": DDPSettings}
    if head in nested:
        return [k for k in nested[head].model_fields]
    if head == "tolerances":
        return list(PRECISIONS) + ["rtol", "atol"]
    return []


def load_spec(path: str | os.PathLike[str]) -> Spec:
    """Read and validate a spec file; raise SpecError with a readable paragraph."""
    path = Path(path)
    data, text = read_spec_yaml(path)
    if data is None:
        raise SpecError(f"{path}: the spec is empty; it needs at least model, data, train_loop "
                        "and accumulation_steps.")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the spec must be a YAML mapping of keys, not a "
                        f"{type(data).__name__}.")
    if len(data) > MAX_SPEC_KEYS:
        raise SpecError(f"{path}: the spec has {len(data):,} top-level keys; it knows "
                        f"{len(Spec.model_fields) - 1}.")
    lines = top_level_lines(text)
    non_string = [k for k in data if not isinstance(k, str)]
    if non_string:
        raise SpecError(f"{path}: spec keys must be names, got {non_string[0]!r}.")
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError("\n".join(validation_messages(exc, path, lines)), cause=exc) from exc
    spec.spec_path = path.resolve()
    line = lines.get("project_root")
    try:
        root = spec.root
        is_dir = root.is_dir()
    except (OSError, ValueError) as exc:   # UnicodeEncodeError: a name the file system refuses
        raise SpecError(_paragraph(path, "project_root", line,
                                   f"{spec.project_root!r} is not a usable folder name ({exc})."),
                        cause=exc) from exc
    if not is_dir:
        raise SpecError(_paragraph(path, "project_root", line,
                                   f"the folder {root} does not exist."))
    for p in spec.scan_paths():
        if not p.exists():
            raise SpecError(_paragraph(path, "scan.paths", lines.get("scan.paths"),
                                       f"{p} does not exist."))
    return spec


def spec_line(spec: Spec, key: str) -> int | None:
    """The YAML line of a top-level key, for messages raised after validation."""
    if spec.spec_path is None:
        return None
    try:
        return top_level_lines(spec.spec_path.read_text(encoding="utf-8")).get(key)
    except OSError:
        return None


# --- the spec sent to the processes of the ddp-sync rung -----------------------------------

def to_wire(spec: Spec) -> str:
    """The spec as the ddp-sync rung's rank processes rebuild it: its file (for its folder and
    messages) and its keys with every override applied. A callable given in code travels as
    its 'module:function', which must be importable by name (SpecError otherwise)."""
    import importlib
    import json

    for key, obj in spec._callables.items():
        ref = str(getattr(spec, key))
        module_name, _, qualname = ref.partition(":")
        found: Any = None
        try:
            if module_name != "__main__" and "<" not in qualname:
                found = importlib.import_module(module_name)
                for part in qualname.split("."):
                    found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is not obj:
            raise SpecError(f"spec key '{key}': the ddp-sync rung runs the loop in new "
                            f"processes, which import the spec's code by name, and {ref} "
                            "cannot be imported there: define it at the top level of an "
                            "importable module (or give 'module:function').")
    data = spec.model_dump(mode="json", exclude={"spec_path"}, exclude_unset=True)
    return json.dumps({"path": str(spec.spec_path) if spec.spec_path else None, "keys": data,
                       "cwd": str(Path.cwd())})


def from_wire(text: str) -> Spec:
    """The spec `to_wire` sent (a plain path also works: a YAML spec file)."""
    import json

    if not text.lstrip().startswith("{"):
        return load_spec(text)
    wire = json.loads(text)
    if wire.get("cwd") and wire["path"] is None:
        os.chdir(wire["cwd"])   # a spec built in code: project_root is relative to it
    spec = Spec.model_validate(wire["keys"])
    spec.spec_path = Path(wire["path"]) if wire["path"] else None
    return spec


def json_schema() -> dict[str, Any]:
    """The spec's JSON Schema (from the pydantic model), as editors want it."""
    schema = Spec.model_json_schema()
    schema["properties"].pop("spec_path", None)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ampdoctor spec"
    schema["description"] = ("What `ampdoctor diagnose` runs: the model and data factories, the "
                             "training loop, K, and how much of it to run.")
    return schema
