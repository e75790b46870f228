"""Renderings of a `ScanReport`: rich terminal text, JSON, SARIF 2.1.0.

Scanned file names, config keys and the messages quoting them are the user's world: in the
terminal every one goes through `safetext.inert` (no ESC, OSC, C1, CR or bidi override reaches
it raw) and `rich.markup.escape`. JSON and SARIF are written with `ensure_ascii` (no raw
control or non-ASCII byte at all) and their text fields (messages, details, reasons) are made
inert too, for the viewers that show them; a JSON `file` (and `paths`, `entry`, `entries`)
stays the exact path, for the tools that open it; a SARIF `uri` is percent-encoded
(RFC 3986: a space, `#`, `%`, `?`, a control or non-ASCII character never appears raw).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote_from_bytes

from ampdoctor.core.enums import KindId
from ampdoctor.core.safetext import FIELD_LIMIT, MESSAGE_LIMIT, inert
from ampdoctor.kinds import CATALOGUE
from ampdoctor.scan.sites import ScanReport, Site, display_path

#: JSON fields that hold a path (kept exact, JSON-escaped); every other string is made inert.
PATH_KEYS = frozenset({"file", "paths", "entry", "entries", "scan_paths"})


def _one(value: Any) -> str:
    """One line of user text for the terminal (then markup-escaped by the caller)."""
    return inert(value, limit=FIELD_LIMIT, multiline=False)


def _inert_json(value: Any, key: str | None = None) -> Any:
    """The report's dict with its text made inert, its paths (`PATH_KEYS`) exact."""
    if key in PATH_KEYS:
        return value
    if isinstance(value, str):
        return inert(value, limit=MESSAGE_LIMIT)
    if isinstance(value, dict):
        return {k: _inert_json(v, k if isinstance(k, str) else None) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_inert_json(v) for v in value]
    return value

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://github.com/ampdoctor/ampdoctor/blob/main/docs/scan.md"


def to_json(report: ScanReport) -> str:
    return json.dumps(_inert_json(report.to_dict()), indent=2, default=str) + "\n"


def render_text(report: ScanReport, file: IO[str] | None = None, color: bool | None = None) -> None:
    """The terminal report: every owner with file:line, then the findings and their fix."""
    from rich.console import Console
    from rich.markup import escape

    kwargs: dict[str, Any] = {"highlight": False, "soft_wrap": True}
    if file is not None:
        kwargs["file"] = file
    if color is False:
        kwargs.update(no_color=True, force_terminal=False, color_system=None)
    console = Console(**kwargs)
    base = report.display_base

    def row(site: Site) -> str:
        runtime = " [bold](used by the fp16 run)[/]" if site.runtime else ""
        return (
            f"  [bold]{escape(_one(site.kind))}[/] at [cyan]{escape(_one(site.where(base)))}[/]"
            f"{runtime}\n"
            f"      {escape(_one(site.detail))}"
        )

    skipped = len(report.skipped)
    console.print(
        f"[bold]ampdoctor scan[/]: {report.files_scanned} file(s) searched in "
        f"{report.seconds:.2f} s"
        + (f", {skipped} skipped" if skipped else "")
    )
    if report.owners:
        console.print(f"\n[bold]Loss-scale owners ({len(report.owners)})[/]")
        for site in report.owners:
            console.print(row(site))
    elif report.findings:
        console.print("\nNo loss-scale owner found (the finding below: precision settings that "
                      "disagree).")
    else:
        console.print("\nNo loss-scale owner found.")
    if report.infos:
        console.print(f"\n[bold]Also seen, not owners ({len(report.infos)})[/]")
        for site in report.infos:
            console.print(row(site), style="dim")
    if report.skipped:
        console.print("\n[bold]Skipped[/]")
        for item in report.skipped[:20]:
            console.print(f"  {escape(_one(display_path(item['file'], base)))}: "
                          f"{escape(_one(item['reason']))}")
        if skipped > 20:
            console.print(f"  ... and {skipped - 20} more (see --json)")
    for finding in report.findings:
        _print_finding(console, finding, base)
    if report.hints:
        console.print(f"\n[bold]Static hints ({len(report.hints)})[/]: patterns read in the code, "
                      "not measured; `ampdoctor diagnose` measures what they cost")
        for hint in report.hints:
            _print_finding(console, hint, base, label="WARNING (hint)")
    console.print(f"\nResult: {_verdict(report)} (exit {report.exit_code})")


def _verdict(report: ScanReport) -> str:
    if report.findings:
        verdict = ("[red]double scaling[/]" if report.status == "fail"
                   else "[yellow]check the owners[/]")
    elif report.owners:
        verdict = "[green]one loss-scale owner per training path[/]"
    else:
        verdict = "[green]nothing to report[/]"
    if report.hints:
        strict = ", failing under --strict" if report.strict else ""
        verdict += f"; [yellow]{len(report.hints)} static hint(s) (warnings{strict})[/]"
    return verdict


def _print_finding(console: Any, finding: Any, base: str | None, label: str = "") -> None:
    from rich.markup import escape

    colour = "red" if finding.severity == "error" else "yellow"
    loc = finding.location
    where = f" at {_one(display_path(loc.file, base))}:{_one(loc.line)}" if loc else ""
    console.print(
        f"\n[bold {colour}]{escape(_one(label or finding.severity.upper()))} "
        f"{escape(_one(finding.kind))}[/]{escape(where)}: {escape(_one(finding.title))}"
    )
    console.print(f"  {escape(inert(finding.message, limit=MESSAGE_LIMIT))}")
    console.print(f"  [bold]fix[/]: {escape(inert(finding.fix, limit=MESSAGE_LIMIT))}")


def _uri(path: str, base: str) -> tuple[str, bool]:
    """A valid URI for `path` (RFC 3986, as SARIF requires): relative to `base` (a relative
    reference, resolved against `%SRCROOT%`) when under it, else a `file:` URI. Every byte
    outside the unreserved set and `/` is percent-encoded (space, `#`, `%`, `?`, `:`, controls,
    non-ASCII as UTF-8; a file name that is not UTF-8 as its own bytes)."""
    rel = display_path(path, base)
    if os.path.isabs(rel):
        try:
            return Path(rel).as_uri(), False
        except ValueError:   # pragma: no cover - an absolute path as_uri refuses
            pass
    return quote_from_bytes(os.fsencode(rel.replace(os.sep, "/")), safe="/"), True


def _artifact(path: str, base: str) -> dict[str, Any]:
    uri, relative = _uri(path, base)
    artifact: dict[str, Any] = {"uri": uri}
    if relative:
        artifact["uriBaseId"] = "%SRCROOT%"
    return artifact


def _physical(path: str, line: int | None, base: str) -> dict[str, Any]:
    return {"artifactLocation": _artifact(path, base), "region": {"startLine": int(line or 1)}}


def _text(value: Any) -> dict[str, str]:
    """A SARIF message: the text made inert (viewers show it as it is)."""
    return {"text": inert(value, limit=MESSAGE_LIMIT)}


#: For other SARIF writers (`diagnose --sarif`): a `physicalLocation` with a valid URI, and a
#: message with its text made inert.
physical_location = _physical
sarif_text = _text


def _rule(kind: str) -> dict[str, Any]:
    """The SARIF rule of a static hint's kind (its catalogue text)."""
    entry = CATALOGUE[kind]
    return {
        "id": kind,
        "name": "".join(part.capitalize() for part in kind.split("-")),
        "shortDescription": {"text": entry.title},
        "fullDescription": {"text": entry.why},
        "help": {"text": entry.fix},
        "defaultConfiguration": {"level": "warning"},
    }


def to_sarif(report: ScanReport) -> str:
    """SARIF 2.1.0 for code-scanning CI: the rule `double-scaling`, then one rule per kind of
    static hint found (warnings)."""
    from ampdoctor._version import __version__

    base = report.display_base or os.getcwd()
    kind = CATALOGUE[KindId.DOUBLE_SCALING]
    results: list[dict[str, Any]] = []
    for finding in report.findings:
        owners: list[dict[str, Any]] = finding.evidence.get("owners", [])
        loc = finding.location
        related = []
        for index, owner in enumerate(owners):
            key = f" ({owner['key_path']})" if owner.get("key_path") else ""
            related.append(
                {
                    "id": index,
                    "physicalLocation": _physical(owner["file"], owner.get("line"), base),
                    "message": _text(f"loss-scale owner: {owner['kind']}{key}"),
                }
            )
        results.append(
            {
                "ruleId": KindId.DOUBLE_SCALING,
                "ruleIndex": 0,
                "level": "error" if finding.severity == "error" else "warning",
                "message": _text(finding.message),
                "locations": [
                    {"physicalLocation": _physical(
                        loc.file if loc else owners[0]["file"],
                        loc.line if loc else owners[0].get("line"),
                        base,
                    )}
                ],
                "relatedLocations": related,
                "properties": {
                    "measured": finding.evidence.get("measured"),
                    "expected": finding.evidence.get("expected"),
                    "scope": finding.evidence.get("scope"),
                },
            }
        )
    hint_kinds = sorted({h.kind for h in report.hints})
    for hint in report.hints:
        loc = hint.location
        results.append(
            {
                "ruleId": hint.kind,
                "ruleIndex": 1 + hint_kinds.index(hint.kind),
                "level": "warning",
                "message": _text(hint.message),
                "locations": [{"physicalLocation": _physical(
                    loc.file if loc else "", loc.line if loc else None, base)}],
                "properties": {"static": True, "title": inert(hint.title, limit=FIELD_LIMIT)},
            }
        )
    notifications = [
        {
            "level": "note",
            "message": _text(f"skipped: {item['reason']}"),
            "locations": [
                {"physicalLocation": {"artifactLocation": _artifact(item["file"], base)}}
            ],
        }
        for item in report.skipped
    ]
    sarif = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "ampdoctor",
                        "version": __version__,
                        "informationUri": INFORMATION_URI,
                        "rules": [
                            {
                                "id": KindId.DOUBLE_SCALING,
                                "name": "DoubleScaling",
                                "shortDescription": {"text": kind.title},
                                "fullDescription": {"text": kind.why},
                                "help": {"text": kind.fix},
                                "defaultConfiguration": {"level": "error"},
                            }
                        ] + [_rule(kind) for kind in hint_kinds],
                    }
                },
                "originalUriBaseIds": {"%SRCROOT%": {"uri": Path(base).as_uri().rstrip("/") + "/"}},
                "invocations": [
                    {
                        "executionSuccessful": True,
                        "exitCode": report.exit_code,
                        "toolExecutionNotifications": notifications,
                    }
                ],
                "results": results,
            }
        ],
    }
    return json.dumps(sarif, indent=2) + "\n"
