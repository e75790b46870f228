"""What `diagnose` gives a CI system besides the record: `--strict`, `--junit FILE`,
`--sarif FILE`.

- `--strict`: a warning fails the run. The record gets `"strict": true`; a healthy record with a
  warning (a finding of severity `warning`, or a rung `warn`) then exits 1 (`record.exit_code`
  reads it, so `report --record-exit-code` agrees) and says so in a note the report shows.
- `--junit FILE`: JUnit XML, one `<testcase>` per rung in ladder order: `<failure>` for `fail`
  (and for `warn` under `--strict`), `<skipped>` for `skip` and `not-run`, the findings of the
  rung (kind, message, the user's `file:line`, fix) in the failure's text or in `<system-out>`.
  A run that stopped before any rung is one `<testcase name="setup">` with an `<error>`.
- `--sarif FILE`: SARIF 2.1.0, one result per finding (rule = its kind, level `error` or
  `warning`) at the user's `file:line` (a path under the working directory relative to
  `%SRCROOT%`, others as `file:` URIs).

The files are written after the run and before the record is shown; a FILE whose folder does
not exist or cannot be written is a usage error (exit 2) before anything runs. Every text field
from the record (the user's world: messages, paths, code) is made inert first: no control
character reaches the XML (where most are not even allowed) or a SARIF viewer.
"""

from __future__ import annotations

import json
import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import UsageError
from ..core.safetext import FIELD_LIMIT, MESSAGE_LIMIT, inert

if TYPE_CHECKING:
    from ..record.model import FindingModel, RecordModel

#: A rung status -> what it is in JUnit (`warn` is `failure` only under --strict).
_SKIPPED = ("skip", "not-run")


def warnings_of(record: RecordModel) -> list[FindingModel]:
    """The findings of severity `warning` (a `warn` rung's findings)."""
    return record.warnings


@dataclass(frozen=True)
class CiOptions:
    strict: bool = False
    junit: Path | None = None
    sarif: Path | None = None

    def check(self) -> None:
        """UsageError (exit 2, before anything runs) for a FILE that cannot be written."""
        for option, path in (("--junit", self.junit), ("--sarif", self.sarif)):
            if path is None:
                continue
            folder = Path(os.path.abspath(path)).parent
            if Path(path).is_dir():
                raise UsageError(f"{option} {path}: is a folder; give a file name.")
            if not folder.is_dir():
                raise UsageError(f"{option} {path}: the folder {folder} does not exist.")
            if not os.access(folder, os.W_OK):
                raise UsageError(f"{option} {path}: the folder {folder} cannot be written.")

    def mark(self, record: RecordModel) -> None:
        """Under --strict: flag the record, and say when its warnings fail the run."""
        if not self.strict:
            return
        record.strict = True
        found = warnings_of(record)
        warned = [r.id for r in record.rungs if r.status == "warn"]
        if record.verdict == "healthy" and (found or warned):
            kinds = ", ".join(sorted({f.kind for f in found})) or "a warn rung"
            note = (f"--strict: {len(found) or len(warned)} warning(s) ({kinds}) fail this run: "
                    "exit 1")
            record.notes = [note, *record.notes]

    def write(self, record: RecordModel, err: Any, exit_code: int) -> bool:
        """Write the asked-for files (the process's `exit_code` in them); False (and a clear
        line) when one could not be."""
        shown = record.model_copy(deep=True)
        shown.exit_code = exit_code
        for option, path, text in (("--junit", self.junit, junit_xml),
                                   ("--sarif", self.sarif, sarif_json)):
            if path is None:
                continue
            try:
                Path(path).write_text(text(shown), encoding="utf-8")
            except OSError as exc:
                err.print(inert(f"ampdoctor: usage error: {option} {path}: cannot be written "
                                f"({exc.strerror or type(exc).__name__})"),
                          markup=False, highlight=False, style="bold red")
                return False
            err.print(inert(f"{option[2:]} report written to {path}"), markup=False,
                      highlight=False, style="dim")
        return True


# -- JUnit ---------------------------------------------------------------------------------------

def _where(finding: FindingModel) -> str:
    loc = finding.location
    if loc is not None and loc.file:
        return f"{loc.file}:{loc.line}"
    return ""


def _finding_text(finding: FindingModel) -> str:
    where = _where(finding)
    lines = [f"{finding.severity}: {finding.kind}: {finding.title}", finding.message]
    if where:
        lines.append(f"at {where}")
    if finding.fix:
        lines.append(f"fix: {finding.fix}")
    return inert("\n".join(lines), limit=4 * MESSAGE_LIMIT)


def junit_xml(record: RecordModel | Mapping[str, Any]) -> str:
    """The record as JUnit XML (see the module docstring)."""
    from ..record import as_record  # (pydantic: imported once the worker runs)
    record = as_record(record)
    name = inert(record.name or "run", limit=FIELD_LIMIT, multiline=False)
    strict = bool(record.strict)
    rungs = record.rungs
    by_rung: dict[str, list[FindingModel]] = {}
    for finding in record.findings:
        by_rung.setdefault(finding.rung, []).append(finding)
    suite = ET.Element("testsuite", name=f"ampdoctor.{name}")
    props = ET.SubElement(suite, "properties")
    for key in ("verdict", "exit_code", "failed_rung", "device", "spec", "script", "strict"):
        value = getattr(record, key)
        if value is not None:
            text = json.dumps(value) if isinstance(value, bool) else value
            ET.SubElement(props, "property", name=key,
                          value=inert(text, limit=FIELD_LIMIT, multiline=False))
    counts = {"tests": 0, "failures": 0, "skipped": 0, "errors": 0}
    total = 0.0
    for rung in rungs:
        rid = inert(rung.id, limit=FIELD_LIMIT, multiline=False)
        seconds = _seconds(rung.seconds)
        total += seconds
        case = ET.SubElement(suite, "testcase", classname=f"ampdoctor.{name}", name=rid,
                             time=f"{seconds:.3f}")
        counts["tests"] += 1
        status = rung.status
        findings = by_rung.get(rung.id, [])
        summary = inert(rung.summary, limit=MESSAGE_LIMIT)
        if status == "fail" or (status == "warn" and strict):
            first = next((f for f in findings if f.severity == "error"), None) or \
                (findings[0] if findings else None)
            failure = ET.SubElement(case, "failure",
                                    type=inert(first.kind if first else status,
                                               multiline=False),
                                    message=inert((first.title if first else "") or summary,
                                                  limit=FIELD_LIMIT, multiline=False))
            failure.text = "\n\n".join(_finding_text(f) for f in findings) or summary
            counts["failures"] += 1
        elif status in _SKIPPED:
            ET.SubElement(case, "skipped", message=f"{status}: {summary}")
            counts["skipped"] += 1
        elif findings:
            ET.SubElement(case, "system-out").text = "\n\n".join(_finding_text(f)
                                                                   for f in findings)
    error = record.error
    if not rungs and error is not None:
        case = ET.SubElement(suite, "testcase", classname=f"ampdoctor.{name}", name="setup",
                             time="0.000")
        element = ET.SubElement(case, "error", type=inert(error.type or "error",
                                                          multiline=False),
                                message=inert(error.message, limit=FIELD_LIMIT,
                                              multiline=False))
        element.text = inert(error.message, limit=4 * MESSAGE_LIMIT)
        counts["tests"] += 1
        counts["errors"] += 1
    for key, value in counts.items():
        suite.set(key, str(value))
    suite.set("time", f"{_seconds(record.seconds) or total:.3f}")
    root = ET.Element("testsuites", {"name": "ampdoctor", "time": suite.get("time", "0"),
                                      **{k: str(v) for k, v in counts.items()}})
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _seconds(value: Any) -> float:
    try:
        return max(0.0, float(value or 0.0))
    except (TypeError, ValueError):
        return 0.0


# -- SARIF ---------------------------------------------------------------------------------------

def _location_file(finding: FindingModel, record: RecordModel) -> str | None:
    """The user's file as an absolute path (a relative one is relative to the spec)."""
    loc = finding.location
    if loc is None or not loc.file:
        return None
    file = loc.file
    if not os.path.isabs(file) and record.spec is not None:
        file = os.path.join(os.path.dirname(record.spec), file)
    return os.path.abspath(file)


def sarif_json(record: RecordModel | Mapping[str, Any], base: str | None = None) -> str:
    """The record's findings as SARIF 2.1.0 (see the module docstring)."""
    from .._version import __version__
    from ..kinds import CATALOGUE
    from ..record import as_record  # (pydantic: imported once the worker runs)
    from ..scan.render import SARIF_SCHEMA, physical_location, sarif_text
    record = as_record(record)
    base = base or os.getcwd()
    findings = record.findings
    kinds = sorted({f.kind for f in findings})
    rules = []
    for kind in kinds:
        entry = CATALOGUE.get(kind)
        rule: dict[str, Any] = {"id": kind, "name": "".join(p.capitalize()
                                                            for p in kind.split("-"))}
        if entry is not None:
            rule.update(shortDescription={"text": entry.title},
                        fullDescription={"text": entry.why}, help={"text": entry.fix})
        rules.append(rule)
    results = []
    for finding in findings:
        kind = finding.kind
        result: dict[str, Any] = {
            "ruleId": kind,
            "ruleIndex": kinds.index(kind),
            "level": "error" if finding.severity == "error" else "warning",
            "message": sarif_text(f"{finding.title}: {finding.message}"),
            "properties": {"rung": inert(finding.rung, limit=FIELD_LIMIT),
                           "evidence": _inert_tree(finding.evidence)},
        }
        file = _location_file(finding, record)
        if file is not None and finding.location is not None:
            line = finding.location.line
            result["locations"] = [{"physicalLocation": physical_location(
                file, line if line > 0 else None, base)}]
        results.append(result)
    sarif = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "ampdoctor", "version": __version__,
                                "informationUri": "https://github.com/ampdoctor/ampdoctor",
                                "rules": rules}},
            "originalUriBaseIds": {"%SRCROOT%": {"uri": Path(base).as_uri().rstrip("/") + "/"}},
            "invocations": [{"executionSuccessful": record.verdict != "error",
                             "exitCode": record.exit_code}],
            "properties": {"verdict": record.verdict,
                           "failed_rung": record.failed_rung,
                           "spec": inert(record.spec, limit=FIELD_LIMIT),
                           "script": (inert(record.script, limit=FIELD_LIMIT)
                                      if record.script is not None else None)},
            "results": results,
        }],
    }
    return json.dumps(sarif, indent=2, ensure_ascii=True) + "\n"


def _inert_tree(value: Any) -> Any:
    if isinstance(value, str):
        return inert(value, limit=MESSAGE_LIMIT)
    if isinstance(value, dict):
        return {inert(k, limit=FIELD_LIMIT): _inert_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_inert_tree(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)        # strict JSON has no NaN or Infinity
    return value
