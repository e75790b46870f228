"""The spec (CONTRACT §1): a pydantic model of every key, and YAML loading with line numbers.
Its sections and value checks (the optimizer mapping, the frameworks' settings, ddp, scan)
are in `spec/sections.py`.

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
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from ..core.errors import SpecError
from .sections import (
    CODE_KEYS,
    DDPSettings,
    DeepSpeedSettings,
    HFTrainerSettings,
    LightningSettings,
    OptimizerMapping,
    ScanSettings,
    Tolerance,
    _check_callable,
    _Strict,
    code_ref,
    fold_optimizer_errors,
)
from .sections import (
    TORCH_OPTIMIZERS as TORCH_OPTIMIZERS,  # re-exported: the spec's public names
)
from .sections import (
    CodeRef as CodeRef,
)
from .yaml_file import read_spec_yaml, top_level_lines

DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
PRECISIONS = ("fp32", "bf16", "fp16")
Precision = Literal["fp32", "bf16", "fp16"]


def check_rung_ids(value: list[str] | None) -> list[str] | None:
    """Rung ids in ladder order; ValueError naming an unknown one (and the closest id)."""
    if value is None:
        return None
    from ..core.findings import RUNG_IDS
    for rung in value:
        if rung not in RUNG_IDS:
            close = difflib.get_close_matches(rung, RUNG_IDS, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"{rung!r} is not a rung.{hint} Rungs: {', '.join(RUNG_IDS)}")
    return [r for r in RUNG_IDS if r in value]


def check_precisions(value: list[str]) -> list[str]:
    """The precisions in run order, fp32 first (it always runs: everything is compared with
    it); ValueError for one listed twice."""
    if len(set(value)) != len(value):
        raise ValueError("a precision is listed twice")
    return ["fp32"] + [p for p in ("bf16", "fp16") if p in value]


def check_device(value: str) -> str:
    if not DEVICE_RE.match(value):
        raise ValueError(f"{value!r} is not a device: use auto, cpu, cuda or cuda:N")
    return value


def _every_precision() -> list[Precision]:
    return ["fp32", "bf16", "fp16"]


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
    deepspeed: DeepSpeedSettings | None = None
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
    #: run every rung even after one failed (each later one marked "after a failure")
    keep_going: bool = False

    # Filled in by load_spec, not by the user.
    spec_path: Path | None = Field(default=None, exclude=True)
    #: callables given in code, by key (their `CodeRef` is the key's value)
    _callables: dict[str, Any] = PrivateAttr(default_factory=dict)
    #: keys whose value came from an override, not the file: key -> where ("--steps")
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

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
        given = [k for k in ("train_loop", "hf_trainer", "lightning", "deepspeed")
                 if getattr(self, k)]
        choice = ("'train_loop' (your loop), 'hf_trainer' (a transformers Trainer factory), "
                  "'lightning' (a LightningModule factory) or 'deepspeed' (a DeepSpeed config)")
        if not given:
            raise ValueError(f"spec key 'train_loop' is missing: give exactly one of {choice}")
        if len(given) > 1:
            raise ValueError(f"give exactly one of {choice}; this spec gives "
                             f"{' and '.join(given)}")
        if self.deepspeed is not None and self.loss is None:
            raise ValueError("spec key 'loss' is missing: with 'deepspeed', ampdoctor computes "
                             "each micro-batch's loss with it (`loss(engine, micro_batch)`)")
        if self.model is None and self.lightning is None:
            raise ValueError("spec key 'model' is missing: a 'module:function' that returns "
                             "the torch.nn.Module to train")
        return self

    @field_validator("rungs")
    @classmethod
    def _rung_ids(cls, value: list[str] | None) -> list[str] | None:
        return check_rung_ids(value)

    def callable_for(self, key: str) -> Any | None:
        """The object given in code for `key`, or None when the key is a reference string."""
        return self._callables.get(key)

    def with_overrides(self, origins: dict[str, str] | None = None, **overrides: Any) -> Spec:
        """This spec with some keys replaced (the CLI's --steps, --device, ...), validated
        again; SpecError naming the key and where its value came from when it is not valid.
        `origins`: key -> where the value came from ("--steps"); by default `the override
        KEY=`. Messages about an overridden key name that, never the file's line."""
        if not overrides:
            return self
        came_from = {key: (origins or {}).get(key, f"the override {key}=") for key in overrides}
        data = self.model_dump(exclude={"spec_path"}, exclude_unset=True)
        data.update(self._callables)
        data.update(overrides)
        try:
            spec = Spec.model_validate(data)
        except ValidationError as exc:
            raise SpecError("\n".join(validation_messages(
                exc, Path("override"), {}, origins=came_from)), cause=exc) from exc
        spec.spec_path = self.spec_path
        spec._origins = {**self._origins, **came_from}
        return spec

    def origin(self, key: str) -> str | None:
        """Where an overridden key's value came from ("--steps"); None when the file (or the
        code that built the spec) gave it."""
        return self._origins.get(key.split(".")[0])

    def overridden(self) -> str:
        """The overrides in effect, as messages state them: `optimizer_steps = 5 (from
        --steps)`, joined with '; ' ('' when none)."""
        return "; ".join(f"{key} = {_shown_value(getattr(self, key))} (from {where})"
                         for key, where in self._origins.items())

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
        return check_precisions(value)

    @field_validator("dropout", mode="before")
    @classmethod
    def _dropout(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false
        return "off" if value is False else value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device(value)

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
    key = ".".join(parts)  # "" for a rule over several keys: its message names them
    line = None
    for n in range(len(parts), 0, -1):
        line = lines.get(".".join(parts[:n]))
        if line is not None:
            break
    return key, line


def _shown_value(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def _paragraph(path: Path, key: str, line: int | None, what: str) -> str:
    where = f"{path}:{line}" if line else str(path)
    return f"{where}: spec key '{key}': {what}" if key else f"{where}: {what}"


#: Top-level keys beyond this are not worth a "did you mean" each.
MAX_SPEC_KEYS = 200
#: Problems listed in a spec error; the rest are counted.
MAX_SPEC_ERRORS = 20


def validation_messages(exc: ValidationError, path: Path, lines: dict[str, int],
                        origins: dict[str, str] | None = None) -> list[str]:
    """One sentence per problem, each naming the key and the line (at most MAX_SPEC_ERRORS;
    the rest are counted in a last line). A key in `origins` is named by where its value came
    from (`--steps: spec key 'optimizer_steps': ...`), not by a line of the file."""
    messages: list[str] = []
    seen: set[str] = set()
    known = list(Spec.model_fields.keys())
    known.remove("spec_path")
    # Unknown keys first: a typo'd key is usually also the "missing" one.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    errors = fold_optimizer_errors(errors)
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
        origin = (origins or {}).get(key.split(".")[0])
        paragraph = (f"{origin}: spec key '{key}': {text}" if origin
                     else _paragraph(path, key, line, text))
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
                       "cwd": str(Path.cwd()), "origins": spec._origins})


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
    spec._origins = dict(wire.get("origins") or {})
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
