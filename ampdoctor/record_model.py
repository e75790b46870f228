"""The run record as a typed model: `report` validates what it loads before rendering it, so a
record with wrong types or missing keys is one clear line naming the field (exit 2), never a
traceback in a renderer. Extra keys are kept (newer records), missing optional ones get defaults
(older records). No torch here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import UsageError

Scalar = str | int | float | bool | None


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class SourceModel(_Open):
    """A few lines of the user's file around a finding's line, read at diagnose time."""

    file: str = ""
    start: int = 1
    line: int = 1
    lines: list[str] = Field(default_factory=list)


class LocationModel(_Open):
    file: str
    line: int
    function: str | None = None
    code: str | None = None


class FindingModel(_Open):
    rung: str
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


class RungModel(_Open):
    id: str
    status: str
    summary: str = ""
    seconds: float = 0.0
    #: --keep-going: this rung ran (or was skipped) after the first failure
    after_failure: bool = False


class ErrorModel(_Open):
    type: str = ""
    message: str = ""
    exit_code: int | None = None
    location: LocationModel | None = None
    source: SourceModel | None = None
    traceback: str | None = None


class SeriesModel(_Open):
    scale: list[float | None] = Field(default_factory=list)
    grad_norm_before_unscale: list[float | None] = Field(default_factory=list)
    grad_norm_after_unscale: list[float | None] = Field(default_factory=list)
    skipped: list[bool | None] = Field(default_factory=list)


class RunSeriesModel(_Open):
    """One judged run's chart series (`ladder/series.py`)."""

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


class RecordModel(_Open):
    record_version: int = 1
    ampdoctor_version: str = ""
    name: str = "run"
    spec: str | None = None
    device: str = "unknown"
    verdict: Literal["healthy", "failed", "inconclusive", "error"]
    #: why a run with no failure is not healthy (verdict inconclusive): nothing was compared
    inconclusive: str | None = None
    #: script mode: the script, its args, the reference's args and how they were had
    script: str | None = None
    args: list[str] | None = None
    reference_args: list[str] | None = None
    reference_args_origin: Literal["given", "inferred"] | None = None
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


def validate(data: Any, source: str) -> dict[str, Any]:
    """The record as plain data with every default filled, or UsageError naming the field."""
    try:
        model = RecordModel.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(the record)"
        more = exc.error_count() - 1
        raise UsageError(f"{source}: not a valid ampdoctor run record: field '{field}': "
                         f"{first['msg']}" + (f" (and {more} more problem(s))" if more else "")
                         + ".") from exc
    return model.model_dump()
