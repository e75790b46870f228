"""The `Finding` / `RungResult` data every rung returns, and the rung ids (`RungId`).

What each kind means, how to fix it and how it is decided is said in one place, its unit under
`ampdoctor/kinds/` (`ampdoctor explain KIND` prints it; `KINDS`, `CATALOGUE`, `RULES` are
importable from `ampdoctor.kinds`); a kind's decider fills a finding's title and fix from its
catalogue entry. Grep a kind's `KindId` member to find where it is observed.

This module must not import torch: `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .enums import KindId, RungId, Severity, Status
from .evidence import Evidence

__all__ = ["Severity", "Status", "KindId", "RungId", "RUNG_IDS", "RUNG_STATUSES", "Evidence",
           "Location", "location", "Finding", "RungResult", "conclude", "status_from_findings"]

#: The rung ids, in ladder order (the order of `RungId`).
RUNG_IDS: tuple[RungId, ...] = tuple(RungId)

RUNG_STATUSES: tuple[Status, ...] = tuple(Status)


@dataclass(frozen=True)
class Location:
    """Where the offending call stands in the user's code."""

    file: str
    line: int
    function: str | None = None
    code: str | None = None

    def short(self) -> str:
        return f"{self.file}:{self.line}"


def location(site: Any) -> Location | None:
    """The Location of a probe call site (`probe.callsite.Site`), or None."""
    if site is None:
        return None
    return Location(site.file, site.line, site.function, site.code or None)


@dataclass(frozen=True)
class Finding:
    """One diagnosis: a kind from the catalogue plus the numbers of this run (built only by the
    kind's decider, which gives it the catalogue's title and fix unless the rule wrote its own)."""

    #: a `RungId`, or "scan" for a finding of the static scan
    rung: str
    kind: KindId
    severity: Severity
    message: str
    evidence: Evidence = field(default_factory=lambda: Evidence())
    location: Location | None = None
    title: str = ""
    fix: str = ""
    #: the full traceback, for a loop that raised (shown with --debug, kept in the record)
    traceback: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in tuple(KindId):
            raise ValueError(f"unknown finding kind {self.kind!r}")
        if self.severity not in tuple(Severity):
            raise ValueError(f"unknown severity {self.severity!r}")
        # a kind or severity given as its plain string (a record read back) becomes the member
        object.__setattr__(self, "kind", KindId(self.kind))
        object.__setattr__(self, "severity", Severity(self.severity))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"], data["severity"] = self.kind.value, self.severity.value
        if self.traceback is None:
            del data["traceback"]
        if self.location is not None:
            data["location"] = {k: v for k, v in data["location"].items() if v is not None}
        return data


@dataclass(frozen=True)
class RungResult:
    """What a rung established: its status, a one-line summary and its findings."""

    id: RungId
    status: Status
    summary: str = ""
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # an id or status given as its plain string becomes the member (ValueError if unknown)
        object.__setattr__(self, "id", RungId(self.id))
        object.__setattr__(self, "status", Status(self.status))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id.value,
            "status": self.status.value,
            "seconds": round(self.seconds, 3),
            "summary": self.summary,
            "details": self.details,
        }


def conclude(rung: RungId, findings: list[Finding], summary_ok: str,
             details: dict[str, Any] | None = None) -> RungResult:
    """A rung's result from its findings: failed on the first error (the summary names it),
    `warn` with the count of warnings, else `pass` with `summary_ok`."""
    status = status_from_findings(findings)
    if status is Status.FAIL:
        first = next(f for f in findings if f.severity is Severity.ERROR)
        summary = f"{first.kind}: {first.message}"   # whole: the terminal wraps it
    elif status is Status.WARN:
        summary = f"{summary_ok}; {len(findings)} warning(s)"
    else:
        summary = summary_ok
    return RungResult(rung, status, summary, findings, details=details or {})


def status_from_findings(findings: list[Finding]) -> Status:
    """`fail` on any error, `warn` on warnings only, else `pass`."""
    if any(f.severity is Severity.ERROR for f in findings):
        return Status.FAIL
    if findings:
        return Status.WARN
    return Status.PASS
