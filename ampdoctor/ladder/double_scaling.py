"""The `double-scaling` rung (CONTRACT §3): one loss-scale state machine only, in code and configs.

The search is static (`ampdoctor.scan`): it reads the spec's `scan.paths` (default
`project_root`) without importing anything, and adds the owner the fp16-scaler trace saw at
run time (the GradScaler the loop really used), merged with the static one at that file:line.
No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampdoctor.core.enums import RungId
from ampdoctor.core.findings import RungResult, status_from_findings
from ampdoctor.kinds.double_scaling import Untold
from ampdoctor.scan import describe, scan_paths
from ampdoctor.scan.verdict import same_path_finding

if TYPE_CHECKING:
    from ampdoctor.core.findings import Finding
    from ampdoctor.rules.scaler_ownership import Ownership
    from ampdoctor.scan.sites import ScanReport

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
             ownership: Ownership | None = None,
             executed: list[str] | None = None) -> RungResult:
    """Run the static search over `scan_paths_` and turn it into the rung's result.

    `runtime_owner`: `{"kind": "GradScaler", "file": "/abs/train.py", "line": 12}` from the
    fp16-scaler trace, or None. `constructed`: every (file, line) where the diagnosed runs
    built a GradScaler (None: no run was traced); a GradScaler in the loop's own files that no
    run ever built (another function's, never called) is not on this loop's path; so is one in
    `executed`, the files the runs ran code in (a helper module's step function).
    `ownership`: which GradScaler scaled which loss and stepped which optimizer in a run
    (`rules.scaler_ownership`); two owners that run saw on disjoint losses and optimizers are
    two separate state machines, not a double scaling. Paths that do not exist are listed
    under `skipped`.
    """
    paths = [os.path.abspath(os.fspath(p)) for p in scan_paths_]
    base = _base(paths)
    report = scan_paths(paths, runtime_owner=runtime_owner, display_base=base, missing_ok=True)
    owners = report.owners
    findings = list(report.findings)
    focus = {os.path.realpath(f) for f in focus_files or []}
    elsewhere = 0
    if focus:
        # In a diagnose, only owners on the diagnosed loop's own path matter: another script's
        # scaler elsewhere in project_root is that script's business (`ampdoctor scan` shows it).
        kept = [f for f in findings if _touches(f, focus)]
        elsewhere = len(findings) - len(kept)
        findings = kept
    dormant: list[dict[str, Any]] = []
    separate: list[str] = []
    if focus and constructed is not None:
        built = {(os.path.realpath(f), line) for f, line in constructed}
        ran = focus | {os.path.realpath(f) for f in executed or []}
        dormant = [o.to_dict() for o in owners if _idle(o.to_dict(), ran, built)]
        findings = [t for f in findings if (t := _without(f, dormant, base)) is not None]
        findings, separate = _judged_by_run(findings, ownership, base)
    summary = _summary(findings, report, focus, dormant, base)
    if separate:
        summary += "; " + "; ".join(separate)
    if dormant:
        summary += ("; not counted, never built by this loop's runs: "
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
            "scaler_ownership": ownership.to_dict() if ownership is not None else None,
        },
    )


def _summary(findings: list[Finding], report: ScanReport, focus: set[str],
             dormant: list[dict[str, Any]], base: str | None) -> str:
    """The rung's summary, before its notes: the worst finding's owners, or this loop's owners
    (a diagnose), or every owner the scan found."""
    owners = report.owners
    errors = [f for f in findings if f.severity == "error"]
    warnings = [f for f in findings if f.severity == "warning"]
    runtime = next((s for s in owners if s.runtime), None)
    runtime_note = ""
    if runtime is not None:
        runtime_note = f"; the fp16 run used {describe(runtime, base)}"

    if errors or warnings:
        worst = max(errors or warnings, key=lambda f: f.evidence.get("measured", 0))
        named = " and ".join(f"{o['kind']} at {_where(o, base)}" for o in worst.evidence["owners"])
        if worst.evidence.get("config_state"):
            summary = ("an HF Trainer and its DeepSpeed config disagree on the precision: "
                       + named + runtime_note)
        elif worst.evidence.get("scope") == "separate-entry-points":
            summary = "loss-scale owners in separate entry points: " + named + runtime_note
        else:
            summary = (f"{worst.evidence['measured']} loss-scale owners on one training path: "
                       + named + runtime_note)
    elif focus:
        summary = _loop_summary(owners, focus, dormant, base)
    elif len(owners) == 1:
        summary = f"one loss-scale owner: {describe(owners[0], base)}"
        if owners[0].runtime:
            summary += " (the one the fp16 run used)"
    elif owners:
        listed = ", ".join(describe(o, base) for o in owners[:4])
        if len(owners) > 4:
            listed += f", ... ({len(owners) - 4} more)"
        summary = (f"{len(owners)} loss-scale owners, each alone on its training path: "
                   + listed + runtime_note)
    else:
        summary = f"no loss-scale owner in {report.files_scanned} file(s)"
    return summary


def _loop_summary(owners: list, focus: set[str], dormant: list[dict[str, Any]],
                  base: str | None) -> str:
    """Name the owners on this loop's path (its files, less the scalers no run of it built);
    count the other scripts' owners, not list them."""
    idle = {(os.path.realpath(o["file"]), o.get("line")) for o in dormant}
    on_path = [o for o in owners if (o.runtime or os.path.realpath(o.file) in focus)
               and (os.path.realpath(o.file), o.line) not in idle]
    others = sum(1 for o in owners if not o.runtime and os.path.realpath(o.file) not in focus)
    counted = "one loss-scale owner" if len(on_path) == 1 else f"{len(on_path)} loss-scale owners"
    if len(on_path) > 1 or others or dormant:
        counted += " on this loop's path"
    listed = ", ".join(describe(o, base) + (" (the one the fp16 run used)" if o.runtime else "")
                       for o in on_path)
    summary = f"{counted}: {listed}" if on_path else "no loss-scale owner on this loop's path"
    if others:
        summary += (f"; {others} more in other scripts of the scanned tree, each alone on "
                    "its own path (see `ampdoctor scan`)")
    return summary


def _idle(owner: dict[str, Any], focus: set[str], built: set[tuple[str, int]]) -> bool:
    """A GradScaler built in the loop's own files at a line where no run built one (a
    `scale()` whose GradScaler is built outside the scanned files is no construction)."""
    return (owner.get("kind") == "GradScaler" and bool(owner.get("file"))
            and not owner.get("runtime")
            and "outside the scanned files" not in owner.get("detail", "")
            and os.path.realpath(owner["file"]) in focus
            and (os.path.realpath(owner["file"]), owner.get("line")) not in built)


def _same_owner(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (os.path.realpath(a["file"]), a.get("line")) == (os.path.realpath(b["file"]),
                                                            b.get("line"))


def _without(finding: Finding, dormant: list[dict[str, Any]], base: str | None
             ) -> Finding | None:
    """A same-path finding over the owners this loop's runs built: rebuilt (message, count and
    location from those owners) when some of its owners are dormant, None when fewer than two
    are left."""
    owners = finding.evidence.get("owners", [])
    left = [o for o in owners if not any(_same_owner(o, d) for d in dormant)]
    if len(left) == len(owners):
        return finding
    if len(left) < 2:
        return None
    if finding.evidence.get("scope") != "same-path":
        return finding      # owners in separate entry points: a warning naming them all
    return same_path_finding(left, finding.evidence["entry"], base)


def _judged_by_run(findings: list, ownership: Ownership | None,
                   base: str | None) -> tuple[list, list[str]]:
    """Same-path findings whose owners are all GradScalers the loop's runs built, judged by what
    a run saw them do: kept as errors (with what they shared) when two of them met on one loss
    or optimizer, dropped when each scaled its own losses into its own optimizers, a warning
    when the runs could not tell (no run had them enabled, or one of them scaled nothing or
    stepped nothing)."""
    kept, separate = [], []
    for finding in findings:
        owners = finding.evidence.get("owners", [])
        if (finding.evidence.get("scope") != "same-path"
                or any(o.get("kind") != "GradScaler" or o.get("also_at") for o in owners)):
            kept.append(finding)
            continue
        entry = finding.evidence["entry"]
        if ownership is None:
            kept.append(same_path_finding(owners, entry, base, untold=Untold.NONE_ENABLED))
            continue
        slots = [ownership.slots_at(os.path.realpath(o["file"]), o.get("line")) for o in owners]
        if not all(slots):
            kept.append(finding)
            continue
        site_of = {slot: i for i, group in enumerate(slots) for slot in group}
        met = [m for m in ownership.shared
               if m["how"] == "scaled-twice" or len({site_of.get(s) for s in m["scalers"]}) > 1]
        if met:
            kept.append(same_path_finding(owners, entry, base, _met_note(met, ownership, base)))
            continue
        uses = [[ownership.scalers[s] for s in group] for group in slots]
        if all(any(u.scaled and u.stepped for u in group) for group in uses):
            steps = [", ".join(str(s) for s in sorted(set().union(*(u.stepped for u in group))))
                     for group in uses]
            separate.append(
                "each scaled its own losses and stepped its own optimizer in the run ("
                + ", ".join(f"{_where(o, base)}: optimizer {opts}"
                            for o, opts in zip(owners, steps, strict=True))
                + "): separate state machines, not a double scaling")
            continue
        kept.append(same_path_finding(owners, entry, base, untold=Untold.UNUSED))
    return kept, separate


def _met_note(met: list[dict[str, Any]], ownership: Ownership, base: str | None) -> str:
    """What the run saw the scalers do to one loss or one optimizer's gradients."""
    parts = []
    for m in met[:3]:
        by = _site(ownership, m["by"], base)
        others = " and ".join(_site(ownership, s, base) for s in m["scalers"] if s != m["by"])
        if m["how"] == "scaled-twice":
            parts.append(f"{by} scaled a loss another scale had already multiplied")
        elif m["how"] == "foreign-gradients":
            parts.append(f"optimizer {m['optimizer']}'s gradients held a loss scaled by "
                         f"{others} when {by} unscaled or stepped them")
        else:
            parts.append(f"optimizer {m['optimizer']} was unscaled or stepped by {others} "
                         f"and by {by}")
    return " The run saw it: " + "; ".join(parts) + "."


def _site(ownership: Ownership, slot: int, base: str | None) -> str:
    use = ownership.scalers.get(slot)
    if use is None or use.file is None:
        return f"GradScaler #{slot}"
    return "GradScaler at " + _where({"file": use.file, "line": use.line}, base)


def _touches(finding: Finding, focus: set[str]) -> bool:
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
