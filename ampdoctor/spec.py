"""The spec (CONTRACT §1): a pydantic model of every key, and YAML loading with line numbers.

pydantic does the type checking and defaults; this module turns its errors into one paragraph
per problem that names the key and the YAML line, and suggests the nearest key for a typo.
No torch here: validation must be fast and usable without it.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from . import limits
from .errors import SpecError

CALLABLE_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
PRECISIONS = ("fp32", "bf16", "fp16")


def _check_callable(value: str) -> str:
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
    wrapper: Literal["ddp", "fsdp"] = "ddp"


class OptimizerMapping(BaseModel):
    """`{name: SGD, lr: 0.05, ...}`: a torch.optim class and its keyword arguments."""

    model_config = ConfigDict(extra="allow")
    name: str


class Spec(_Strict):
    name: str | None = None
    project_root: str | None = None
    model: str
    data: str
    loss: str | None = None
    optimizer: str | OptimizerMapping | None = None
    train_loop: str
    accumulation_steps: StrictInt = Field(ge=1, le=1_000_000)
    micro_batch_size: StrictInt | None = Field(default=None, ge=1)
    optimizer_steps: StrictInt = Field(default=3, ge=1, le=1_000_000)
    max_grad_norm: float | None = Field(default=None, gt=0)
    device: str = "auto"
    #: torch.manual_seed takes any 64-bit value; 2**32 - 1 keeps numpy's seeding valid too
    seed: StrictInt = Field(default=0, ge=0, le=2**32 - 1)
    scan: ScanSettings | None = None
    tolerances: dict[Literal["fp32", "bf16", "fp16"], Tolerance] = Field(default_factory=dict)
    ddp: DDPSettings | None = None
    #: align: every forward of micro-batch i runs under the same RNG state in every run of the
    #: loop and in the reference, so dropout masks match; off: functional dropout runs at p = 0.
    dropout: Literal["align", "off"] = "align"
    #: the precisions the user's training uses; rungs of the others are skipped
    precisions: list[Literal["fp32", "bf16", "fp16"]] = Field(
        default_factory=lambda: ["fp32", "bf16", "fp16"], min_length=1)
    #: the longest one rung may run the loop before ampdoctor stops it (exit 3 naming the rung
    #: and where the loop was); the ddp-sync rung is bounded by ddp.timeout_s instead
    timeout_s: float = Field(default=600.0, gt=0, le=7 * 86400)

    # Filled in by load_spec, not by the user.
    spec_path: Path | None = Field(default=None, exclude=True)

    @field_validator("model", "data", "train_loop")
    @classmethod
    def _callable(cls, value: str) -> str:
        return _check_callable(value)

    @field_validator("loss")
    @classmethod
    def _optional_callable(cls, value: str | None) -> str | None:
        return None if value is None else _check_callable(value)

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


# --- YAML with line numbers --------------------------------------------------------------

def _top_level_lines(text: str) -> dict[str, int]:
    """Map each top-level key (and `key.sub` for one level of nesting) to its 1-based line."""
    lines: dict[str, int] = {}
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return lines
    if not isinstance(node, yaml.MappingNode):
        return lines
    for key_node, value_node in node.value:
        key = str(key_node.value)
        lines[key] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            for sub_key, _ in value_node.value:
                lines[f"{key}.{sub_key.value}"] = sub_key.start_mark.line + 1
    return lines


def _describe_location(loc: tuple[Any, ...], lines: dict[str, int]) -> tuple[str, int | None]:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    # pydantic puts the union branch name ('str', 'OptimizerMapping') in the location.
    parts = [p for p in parts if p not in {"str", "OptimizerMapping", "function-after[_optimizer(), union[str,OptimizerMapping]]"}
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


#: A spec is a few hundred bytes; this bounds what a file can make ampdoctor read.
MAX_SPEC_BYTES = 1024 * 1024
#: Values (after YAML aliases are expanded) a spec may hold: an alias bomb stops here.
MAX_SPEC_VALUES = limits.MAX_VALUES
#: Top-level keys beyond this are not worth a "did you mean" each.
MAX_SPEC_KEYS = 200
#: Problems listed in a spec error; the rest are counted.
MAX_SPEC_ERRORS = 20


class SpecLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice is an error (the last value would
    otherwise win in silence)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:   # an unhashable key: SafeLoader reports it itself
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line "
                    f"{first.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _bounded(data: Any, path: Path) -> None:
    if limits.exceeds(data, MAX_SPEC_VALUES):
        raise SpecError(f"{path}: the spec expands to more than {MAX_SPEC_VALUES:,} values "
                        "(YAML aliases nested in aliases?); a spec names code and a few "
                        "settings.")


def validation_messages(exc: ValidationError, path: Path, lines: dict[str, int]) -> list[str]:
    """One sentence per problem, each naming the key and the line (at most MAX_SPEC_ERRORS;
    the rest are counted in a last line)."""
    messages: list[str] = []
    seen: set[str] = set()
    known = list(Spec.model_fields.keys())
    known.remove("spec_path")
    # Unknown keys first: a typo'd key is usually also the "missing" one.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
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
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
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
    nested = {"scan": ScanSettings, "ddp": DDPSettings}
    if head in nested:
        return [k for k in nested[head].model_fields]
    if head == "tolerances":
        return list(PRECISIONS) + ["rtol", "atol"]
    return []


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file; raise SpecError with a readable paragraph."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: the spec file does not exist.")
    if path.is_dir():
        raise SpecError(f"{path}: is a folder; give the path of a YAML spec file.")
    if not path.is_file():
        raise SpecError(f"{path}: is not a regular file (a device or a pipe); give the path of "
                        "a YAML spec file.")
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: the spec is over {MAX_SPEC_BYTES // 1024} KiB; a spec "
                            "names code and a few settings.")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read the spec: {exc}", cause=exc) from exc
    try:
        data = yaml.load(text, Loader=SpecLoader)  # noqa: S506 - a SafeLoader
        _bounded(data, path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{where}: the spec is not valid YAML: {problem}.", cause=exc) from exc
    if data is None:
        raise SpecError(f"{path}: the spec is empty; it needs at least model, data, train_loop "
                        "and accumulation_steps.")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the spec must be a YAML mapping of keys, not a "
                        f"{type(data).__name__}.")
    if len(data) > MAX_SPEC_KEYS:
        raise SpecError(f"{path}: the spec has {len(data):,} top-level keys; it knows "
                        f"{len(Spec.model_fields) - 1}.")
    lines = _top_level_lines(text)
    non_string = [k for k in data if not isinstance(k, str)]
    if non_string:
        raise SpecError(f"{path}: spec keys must be names, got {non_string[0]!r}.")
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError("\n".join(validation_messages(exc, path, lines)), cause=exc) from exc
    spec.spec_path = path.resolve()
    root = spec.root
    if not root.is_dir():
        line = lines.get("project_root")
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
        return _top_level_lines(spec.spec_path.read_text(encoding="utf-8")).get(key)
    except OSError:
        return None
