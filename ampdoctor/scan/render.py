"""Renderings of a `ScanReport`: rich terminal text, JSON, SARIF 2.1.0."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from ampdoctor.findings import CATALOGUE
from ampdoctor.scan.sites import ScanReport, Site, display_path

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://github.com/ampdoctor/ampdoctor/blob/main/docs/scan.md"


def to_json(report: ScanReport) -> str:
    return json.dumps(report.to_dict(), indent=2, default=str) + "\n"


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
            f"  [bold]{escape(site.kind)}[/] at [cyan]{escape(site.where(base))}[/]{runtime}\n"
            f"      {escape(site.detail)}"
        )

    skipped = len(report.skipped)
    console.print(
        f"[bold]ampdoctor scan[/]: {report.files_scanned} file(s) searched in {report.seconds:.2f} s"
        + (f", {skipped} skipped" if skipped else "")
    )
    if report.owners:
        console.print(f"\n[bold]Loss-scale owners ({len(report.owners)})[/]")
        for site in report.owners:
            console.print(row(site))
    else:
        console.print("\nNo loss-scale owner found.")
    if report.infos:
        console.print(f"\n[bold]Also seen, not owners ({len(report.infos)})[/]")
        for site in report.infos:
            console.print(row(site), style="dim")
    if report.skipped:
        console.print("\n[bold]Skipped[/]")
        for item in report.skipped[:20]:
            console.print(f"  {escape(display_path(item['file'], base))}: {escape(item['reason'])}")
        if skipped > 20:
            console.print(f"  ... and {skipped - 20} more (see --json)")
    for finding in report.findings:
        colour = "red" if finding.severity == "error" else "yellow"
        loc = finding.location
        where = f" at {display_path(loc.file, base)}:{loc.line}" if loc else ""
        console.print(
            f"\n[bold {colour}]{finding.severity.upper()} {finding.kind}[/]{escape(where)}: "
            f"{escape(finding.title)}"
        )
        console.print(f"  {escape(finding.message)}")
        console.print(f"  [bold]fix[/]: {escape(finding.fix)}")
    if report.findings:
        verdict = "[red]double scaling[/]" if report.status == "fail" else "[yellow]check the owners[/]"
    elif report.owners:
        verdict = "[green]one loss-scale owner per training path[/]"
    else:
        verdict = "[green]nothing to report[/]"
    console.print(f"\nResult: {verdict} (exit {report.exit_code})")


def _uri(path: str, base: str) -> tuple[str, bool]:
    rel = display_path(path, base)
    if os.path.isabs(rel):
        return Path(rel).as_uri(), False
    return rel.replace(os.sep, "/"), True


def _physical(path: str, line: int | None, base: str) -> dict[str, Any]:
    uri, relative = _uri(path, base)
    artifact: dict[str, Any] = {"uri": uri}
    if relative:
        artifact["uriBaseId"] = "%SRCROOT%"
    return {"artifactLocation": artifact, "region": {"startLine": int(line or 1)}}


def to_sarif(report: ScanReport) -> str:
    """SARIF 2.1.0 for code-scanning CI (one rule, `double-scaling`)."""
    from ampdoctor import __version__

    base = report.display_base or os.getcwd()
    kind = CATALOGUE["double-scaling"]
    results = []
    for finding in report.findings:
        owners = finding.evidence.get("owners", [])
        loc = finding.location
        related = []
        for index, owner in enumerate(owners):
            key = f" ({owner['key_path']})" if owner.get("key_path") else ""
            related.append(
                {
                    "id": index,
                    "physicalLocation": _physical(owner["file"], owner.get("line"), base),
                    "message": {"text": f"loss-scale owner: {owner['kind']}{key}"},
                }
            )
        results.append(
            {
                "ruleId": "double-scaling",
                "ruleIndex": 0,
                "level": "error" if finding.severity == "error" else "warning",
                "message": {"text": finding.message},
                "locations": [
                    {"physicalLocation": _physical(loc.file if loc else owners[0]["file"],
                                                   loc.line if loc else owners[0].get("line"), base)}
                ],
                "relatedLocations": related,
                "properties": {
                    "measured": finding.evidence.get("measured"),
                    "expected": finding.evidence.get("expected"),
                    "scope": finding.evidence.get("scope"),
                },
            }
        )
    notifications = [
        {
            "level": "note",
            "message": {"text": f"skipped: {item['reason']}"},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": _uri(item["file"], base)[0]}}}],
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
                                "id": "double-scaling",
                                "name": "DoubleScaling",
                                "shortDescription": {"text": kind.title},
                                "fullDescription": {"text": kind.why},
                                "help": {"text": kind.fix},
                                "defaultConfiguration": {"level": "error"},
                            }
                        ],
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
