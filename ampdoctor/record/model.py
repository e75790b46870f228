"""The run record as one typed model, from the moment a diagnose starts it to its rendering:
the runner builds a `RecordModel`, the rungs' `Finding`s become `FindingModel`s in one place
(`FindingModel.of`), the renderers (terminal, HTML, JUnit, SARIF, the API's summary) read it,
and it is JSON only at the edges (the worker's wire, `--json`, a saved file, `report` reading
one). `report` validates what it loads, so a record with wrong types or missing keys is one
clear line naming the field (exit 2), never a traceback in a renderer. Extra keys are kept
(newer records), missing optional ones get defaults (older records). No torch here.

A record's JSON holds the keys that were given, in the order they were given (`_Ordered`): what
users diff and their scripts read stays as it was written, while a record read back from disk
shows every default filled (`dump(filled=True)`, what `report --json` prints).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from ..core.errors import UsageError
from ..core.safetext import MESSAGE_LIMIT, inert

if TYPE_CHECKING:
    from ..core.errors import AmpdoctorError
    from ..core.findings import Finding, RungResult

Scalar = str | int | float | bool | None
Verdict = Literal["healthy", "failed", "inconclusive", "error"]

#: `dump(filled=True)`: every field of `FILLED`, defaults included (a record read back).
_FILLED = "filled"


class _Ordered(BaseModel):
    """A part of the record whose JSON holds the keys it was given (by the constructor, by
    validation of a dict, or by assignment), in that order; with `filled`, the `FILLED` fields
    first (defaults included, in declaration order), then the other keys given."""

    model_config = ConfigDict(extra="allow")
    #: the fields a record read back always shows (the ones older versions declared)
    FILLED: ClassVar[tuple[str, ...]] = ()
    _keys: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _given_order(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, _Ordered):
            model._keys = [str(k) for k in data]
        return model

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_") and name not in self._keys:
            self._keys.append(name)

    @model_serializer(mode="wrap")
    def _in_order(self, handler: SerializerFunctionWrapHandler,
                  info: SerializationInfo) -> dict[str, Any]:
        data = handler(self)
        if info.context and info.context.get(_FILLED):
            keys = [*self.FILLED, *(k for k in self._keys if k not in self.FILLED)]
        else:
            keys = self._keys
        return {k: data[k] for k in keys if k in data}

    def dump(self, filled: bool = False) -> dict[str, Any]:
        """As JSON data (Python values: a float may still be NaN), the keys in the order
        given; `filled`: every field a record read back shows, defaults included."""
        return self.model_dump(context={_FILLED: True} if filled else None)

    def given(self, name: str) -> bool:
        """Whether the record holds `name` (given, not a default)."""
        return name in self._keys


class SourceModel(_Ordered):
    """A few lines of the user's file around a finding's line, read at diagnose time."""

    FILLED = ("file", "start", "line", "lines")
    file: str = ""
    start: int = 1
    line: int = 1
    lines: list[str] = Field(default_factory=list)


class LocationModel(_Ordered):
    FILLED = ("file", "line", "function", "code")
    file: str
    line: int
    function: str | None = None
    code: str | None = None


class FindingModel(_Ordered):
    """A finding as the record holds it: the one shape every renderer reads."""

    FILLED = ("rung", "kind", "severity", "message", "title", "fix", "evidence", "location",
              "source", "traceback", "after_failure")
    #: a `RungId`, or "scan" (empty in a hand-made record that names none)
    rung: str = ""
    kind: str
    severity: str
    message: str = ""
    title: str = ""
    fix: str = ""
    evidence: dict[str, Any] = Field(default_factory=dict)
    location: LocationModel | None = None
    source: SourceModel | None = None
    traceback: str | None = None
    #: --keep-going: found by a rung that ran after the first failure
    after_failure: bool = False

    @classmethod
    def of(cls, finding: Finding, after_failure: bool = False) -> FindingModel:
        """The record's finding of a rung's `Finding`: the one place one becomes the other."""
        data = finding.to_dict()
        if after_failure:
            data["after_failure"] = True
        return cls.model_validate(data)


def attach_source(item: FindingModel | ErrorModel) -> None:
    """Give a finding or an error with a location its `source` snippet."""
    from ..core.source_snippet import snippet
    if item.location is None or item.source is not None:
        return
    found = snippet(item.location.file, item.location.line)
    if found is not None:
        item.source = SourceModel.model_validate(found)


class RungModel(_Ordered):
    FILLED = ("id", "status", "summary", "seconds", "after_failure")
    id: str
    status: str
    summary: str = ""
    seconds: float | None = 0.0
    #: --keep-going: this rung ran (or was skipped) after the first failure
    after_failure: bool = False
    #: what the rung measured beyond its status (steps compared, its chart series)
    details: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, result: RungResult) -> RungModel:
        return cls.model_validate(result.to_dict())


class ErrorModel(_Ordered):
    FILLED = ("type", "message", "exit_code", "location", "source", "traceback")
    type: str = ""
    message: str = ""
    exit_code: int | None = None
    location: LocationModel | None = None
    source: SourceModel | None = None
    traceback: str | None = None


class SeriesModel(_Ordered):
    FILLED = ("scale", "grad_norm_before_unscale", "grad_norm_after_unscale", "skipped")
    scale: list[float | None] = Field(default_factory=list)
    grad_norm_before_unscale: list[float | None] = Field(default_factory=list)
    grad_norm_after_unscale: list[float | None] = Field(default_factory=list)
    skipped: list[bool | None] = Field(default_factory=list)


class RunSeriesModel(_Ordered):
    """One judged run's chart series (`ladder/series.py`)."""

    FILLED = ("rung", "precision", "label", "step", "ratio", "bad", "preclip", "update_ratio",
              "clip_norm", "reference_norm", "band", "noise_band", "scale", "skipped",
              "grad_norm_before_unscale", "grad_norm_after_unscale")
    rung: str = ""
    precision: str = ""
    label: str = ""
    step: list[int] = Field(default_factory=list)
    ratio: list[float | None] = Field(default_factory=list)
    bad: list[bool] = Field(default_factory=list)
    preclip: list[bool] = Field(default_factory=list)
    update_ratio: list[float | None] = Field(default_factory=list)
    clip_norm: list[float | None] = Field(default_factory=list)
    reference_norm: list[float | None] = Field(default_factory=list)
    band: list[float] = Field(default_factory=list, max_length=2)
    noise_band: list[float] = Field(default_factory=list, max_length=2)
    scale: list[float | None] = Field(default_factory=list)
    skipped: list[bool | None] = Field(default_factory=list)
    grad_norm_before_unscale: list[float | None] = Field(default_factory=list)
    grad_norm_after_unscale: list[float | None] = Field(default_factory=list)


class RecordModel(_Ordered):
    """The run record. The API's `ampdoctor.Record` is this model: `diagnose()` returns one,
    with `path` (where it was saved) and `exception` (the error that stopped the run)."""

    FILLED = ("record_version", "ampdoctor_version", "name", "spec", "device", "verdict",
              "inconclusive", "script", "args", "reference_args", "reference_args_origin",
              "reference_args_inferred", "reference_literals", "cwd", "output", "exit_code",
              "failed_rung", "keep_going", "accumulation_steps", "rungs", "findings", "notes",
              "series", "runs", "error")
    record_version: int = 1
    ampdoctor_version: str = ""
    name: str = "run"
    spec: str | None = None
    device: str = "unknown"
    verdict: Verdict
    #: why a run with no failure is not healthy (verdict inconclusive): nothing was compared
    inconclusive: str | None = None
    #: script mode: the script, its args, the reference's args and how they were had
    script: str | None = None
    args: list[str] | None = None
    reference_args: list[str] | None = None
    reference_args_origin: Literal["given", "inferred"] | None = None
    #: script mode: true when the reference's args were inferred from the script, false when
    #: given (`--reference-args`), null without a reference (CONTRACT's
    #: `reference_args_inferred`; `reference_args_origin` says the same in a word)
    reference_args_inferred: bool | None = None
    #: script mode: the literals of the script the reference's runs changed, where K and the
    #: micro-batch are written in it rather than options: [{"name", "line", "value"}]
    reference_literals: list[dict[str, Any]] | None = None
    #: script mode: the working directory the script ran in
    cwd: str | None = None
    #: the training code's own output, captured (each script run's, or the loop's runs')
    output: list[dict[str, Any]] | None = None
    exit_code: int | None = None
    failed_rung: str | None = None
    #: --keep-going ran rungs after the first failure (present only then)
    keep_going: bool = False
    accumulation_steps: int | str | None = None
    rungs: list[RungModel] = Field(default_factory=list)
    findings: list[FindingModel] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    series: SeriesModel = Field(default_factory=SeriesModel)
    runs: list[RunSeriesModel] = Field(default_factory=list)
    error: ErrorModel | None = None
    # present when the run wrote them (a record read back shows them only then)
    cuda_available: bool | None = None
    optimizer_steps: int | None = None
    micro_batch_size: int | None = None
    #: where and with what the record was made (`runner.environment`)
    environment: dict[str, Any] | None = None
    #: script mode: what the fp32 run showed of the script (`text`: as one line)
    found: dict[str, Any] | None = None
    seconds: float | None = None
    #: what the fp32 reference was: "loss", "loop" or "script"
    reference_mode: str | None = None
    #: written under --strict (a warning fails the run)
    strict: bool | None = None
    #: `ampdoctor.watch`: what the watch checked
    watch: dict[str, Any] | None = None

    _path: Path | None = PrivateAttr(default=None)
    _exception: AmpdoctorError | None = PrivateAttr(default=None)

    # ------------------------------------------------------------------ the JSON edges
    def to_json(self, filled: bool = False) -> str:
        """The record as strict JSON (RFC 8259 has no NaN or Infinity: a non-finite number,
        such as the gradient norm of a step that overflowed, is written as null), its keys in
        the order they were given; `filled`: every default filled in (a record read back)."""
        return json.dumps(finite(self.dump(filled=filled)), indent=2, default=str,
                          allow_nan=False) + "\n"

    @property
    def data(self) -> dict[str, Any]:
        """The record as the JSON the CLI saves (a dict, as `json.loads` gives it back)."""
        parsed: dict[str, Any] = json.loads(self.to_json())
        return parsed

    # ------------------------------------------------------------------ the API's views
    @property
    def path(self) -> Path | None:
        """Where `diagnose()` saved the record (None with `save=False`)."""
        return self._path

    @property
    def exception(self) -> AmpdoctorError | None:
        """The error that stopped the run before any rung (the user's code), if one did."""
        return self._exception

    def saved(self, path: Path | None, exception: AmpdoctorError | None = None) -> RecordModel:
        """This record, knowing where it was saved and the error that stopped its run."""
        self._path, self._exception = path, exception
        return self

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"

    @property
    def errors(self) -> list[FindingModel]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[FindingModel]:
        return [f for f in self.findings if f.severity == "warning"]

    def extra(self, key: str) -> Any:
        """A key a newer (or another) writer added that this version does not declare."""
        return (self.model_extra or {}).get(key)

    def summary(self) -> str:
        """The diagnosis as plain text: verdict, then each finding's kind, rung, message,
        evidence, file:line and fix (what `assert_healthy` fails with)."""
        return summary_text(self)


def finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, an overflowed norm) as None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def summary_text(record: RecordModel) -> str:
    head = f"ampdoctor: {record.name or 'run'}: {record.verdict.upper()}"
    if record.failed_rung:
        head += f" at rung {record.failed_rung}"
    lines = [head]
    if record.inconclusive:
        lines.append(f"  {record.inconclusive}")
    error = record.error
    if error:
        lines.append(f"  error: {error.message}")
        if error.location:
            lines.append(f"    at {error.location.file}:{error.location.line}")
    for f in record.findings:
        lines.append(f"  {f.severity}: {f.kind} [{f.rung}] {f.title}".rstrip())
        lines.append(f"    {f.message}")
        evidence = {k: v for k, v in f.evidence.items()
                    if not isinstance(v, (dict, list)) or k in ("measured", "expected")}
        if evidence:
            lines.append("    evidence: " + ", ".join(f"{k}={_short(v)}"
                                                      for k, v in evidence.items()))
        loc = f.location
        if loc:
            code = f"    {loc.code}" if loc.code else ""
            lines.append(f"    at {loc.file}:{loc.line}{code}")
        if f.fix:
            lines.append(f"    fix: {f.fix}")
    if record.extra("path"):
        lines.append(f"  record: {record.extra('path')}")
    # every field came from the user's world: shown inert, one line each, bounded
    return "\n".join(inert(line, limit=MESSAGE_LIMIT, multiline=False) for line in lines)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def validate(data: Any, source: str) -> RecordModel:
    """The record read back, or UsageError naming the field."""
    try:
        return RecordModel.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(the record)"
        more = exc.error_count() - 1
        raise UsageError(f"{source}: not a valid ampdoctor run record: field '{field}': "
                         f"{first['msg']}" + (f" (and {more} more problem(s))" if more else "")
                         + ".") from exc
