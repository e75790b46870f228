"""The `double-scaling` rung (CONTRACT §3): one loss-scale state machine only, in code and configs.

The search is static (`ampdoctor.scan`): it reads the spec's `scan.paths` (default
`project_root`) without importing anything, and adds the owner the fp16-scaler trace saw at
run time (the GradScaler the loop really used), merged with the static one at that file:line.
No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ampdoctor.enums import RungId
from ampdoctor.findings import RungResult, status_from_findings
from ampdoctor.scan import describe, scan_paths

RUNG = RungId.DOUBLE_SCALING


def _base(paths: list[str]) -> str | None:
    folders = [p if os.path.isdir(p) else os.path.dirname(p) for p in paths if os.path.exists(p)]
    if not folders:
        return None
    try:
        return os.path.commonpath(folders)
    except ValueError:
        return folders[0]


def evaluate(scan_paths_: list[Path] | list[str], runtime_owner: dict[str, Any] | None = None,
             focus_files: list[str] | None = None,
             constructed: set[tuple[str, int]] | None = None,
             executed: list[str] | None = None) -> RungResult:
    """Run the static search over `scan_paths_` and turn it into the rung's result.

    `runtime_owner`: `{"kind": "GradScaler", "file": "/abs/train.py", "line": 12}` from the
    fp16-scaler trace, or None. `constructed`: every (file, line) where the diagnosed runs
    built a GradScaler; with a runtime owner known, a GradScaler in the loop's own files that
    no run ever built (another function's, never called) is not on this loop's path; so is one
    in `executed`, the files the runs ran code in (a helper module's step function).
    Paths that do not exist are listed under `skipped`.
    """
    paths = [os.path.abspath(os.fspath(p)) for p in scan_paths_]
    base = _base(paths)
    report = scan_paths(paths, runtime_owner=runtime_owner, display_base=base, missing_ok=True)
    owners = report.owners
    findings = list(report.findings)
    elsewhere = 0
    if focus_files:
        # In a diagnose, only owners on the diagnosed loop's own path matter: another script's
        # scaler elsewhere in project_root is that script's business (`ampdoctor scan` shows it).
        focus = {os.path.realpath(f) for f in focus_files}
        kept = [f for f in findings if _touches(f, focus)]
        elsewhere = len(findings) - len(kept)
        findings = kept
    dormant: list[dict[str, Any]] = []
    if runtime_owner is not None and constructed is not None and focus_files:
        findings, dormant = _without_dormant_scalers(findings, constructed,
                                                     focus_files + (executed or []))
    errors = [f for f in findings if f.severity == "error"]
    warnings = [f for f in findings if f.severity == "warning"]
    runtime = next((s for s in owners if s.runtime), None)
    runtime_note = ""
    if runtime is not None:
        runtime_note = f"; the fp16 run used {describe(runtime, base)}"

    if errors:
        worst = max(errors, key=lambda f: f.evidence.get("measured", 0))
        named = [f"{o['kind']} at {_where(o, base)}" for o in worst.evidence["owners"]]
        summary = (f"{worst.evidence['measured']} loss-scale owners on one training path: "
                   + " and ".join(named) + runtime_note)
    elif warnings:
        named = [f"{o['kind']} at {_where(o, base)}" for o in warnings[0].evidence["owners"]]
        summary = ("loss-scale owners in separate entry points: " + " and ".join(named)
                   + runtime_note)
    elif len(owners) == 1:
        summary = f"one loss-scale owner: {describe(owners[0], base)}"
        if owners[0].runtime:
            summary += " (the one the fp16 run used)"
    elif focus_files and len(owners) > 1:
        # Name the owners on this loop's path; count the other scripts' owners, not list them.
        focus = {os.path.realpath(f) for f in focus_files}
        on_path = [o for o in owners if o.runtime or os.path.realpath(o.file) in focus]
        counted = ("one loss-scale owner" if len(on_path) == 1
                   else f"{len(on_path)} loss-scale owners")
        listed = ", ".join(describe(o, base) + (" (the one the fp16 run used)" if o.runtime else "")
                           for o in on_path)
        summary = (f"{counted} on this loop's path: {listed}" if on_path
                   else "no loss-scale owner on this loop's path")
        others = len(owners) - len(on_path)
        if others:
            summary += (f"; {others} more in other scripts of the scanned tree, each alone on "
                        "its own path (see `ampdoctor scan`)")
    elif owners:
        listed = ", ".join(describe(o, base) for o in owners[:4])
        if len(owners) > 4:
            listed += f", ... ({len(owners) - 4} more)"
        summary = (f"{len(owners)} loss-scale owners, each alone on its training path: "
                   + listed + runtime_note)
    else:
        summary = f"no loss-scale owner in {report.files_scanned} file(s)"
    if dormant:
        summary += ("; not counted, never built by this loop: "
                    + ", ".join(f"{o['kind']} at {_where(o, base)}" for o in dormant))
    if report.skipped:
        summary += f" ({len(report.skipped)} file(s) skipped)"
    if elsewhere:
        summary += (f"; {elsewhere} finding(s) elsewhere in the scanned tree, off this loop's "
                    "path (see `ampdoctor scan`)")

    return RungResult(
        id=RUNG,
        status=status_from_findings(findings),
        summary=summary,
        findings=findings,
        seconds=report.seconds,
        details={
            "owners": [o.to_dict() for o in owners],
            "infos": [o.to_dict() for o in report.infos],
            "groups": report.groups,
            "skipped": report.skipped,
            "files_scanned": report.files_scanned,
            "runtime_owner": report.runtime_owner,
            "scan_paths": paths,
            "dormant_owners": dormant,
        },
    )


def _without_dormant_scalers(findings: list, constructed: set[tuple[str, int]],
                             focus_files: list[str]) -> tuple[list, list[dict[str, Any]]]:
    """Drop from each double-scaling finding the GradScalers of the loop's own files that no run
    built; a finding left with a single owner is no finding."""
    focus = {os.path.realpath(f) for f in focus_files}
    built = {(os.path.realpath(f), line) for f, line in constructed}
    kept, dormant = [], []
    for finding in findings:
        owners = finding.evidence.get("owners", [])
        idle = [o for o in owners if o.get("kind") == "GradScaler" and o.get("file")
                and os.path.realpath(o["file"]) in focus
                and (os.path.realpath(o["file"]), o.get("line")) not in built]
        if not idle:
            kept.append(finding)
            continue
        dormant += [o for o in idle if o not in dormant]
        if len(owners) - len(idle) > 1:
            finding.evidence["owners"] = [o for o in owners if o not in idle]
            finding.evidence["measured"] = len(finding.evidence["owners"])
            kept.append(finding)
    return kept, dormant


def _touches(finding, focus: set[str]) -> bool:
    """Does a finding involve one of the diagnosed loop's own files?"""
    ev = finding.evidence
    files = {o.get("file") for o in ev.get("owners", [])}
    files |= {ev.get("entry")} | set(ev.get("entries", []))
    return any(f and os.path.realpath(f) in focus for f in files)


def _where(owner: dict[str, Any], base: str | None) -> str:
    from ampdoctor.scan import display_path

    text = display_path(owner["file"], base)
    if owner.get("line") is not None:
        text += f":{owner['line']}"
    if owner.get("key_path"):
        text += f" ({owner['key_path']})"
    return text
