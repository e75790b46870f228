"""From sites and training paths to owners, groups and `double-scaling` findings.

Rules (docs/scan.md says the same for users):

1. An *owner* is a loss-scale state machine: an enabled GradScaler (a literal `enabled=False`
   is not one; a non-literal `enabled=` is, since it can be on), DeepSpeed `fp16.enabled: true`
   (or DeepSpeed's apex `amp`), Trainer `fp16=True`, accelerate `mixed_precision: fp16`,
   Lightning `precision: 16 / "16-mixed"`, apex `amp.initialize`, or a constant loss scale
   multiplied into the loss before backward. bf16 settings are information, never owners.
2. A `scaler.scale(loss)` whose GradScaler is built in a file on the same training path is
   that GradScaler; one whose GradScaler is built nowhere in the scanned files is an owner.
3. DeepSpeed `"enabled": "auto"` is an owner only on a path where a Trainer, accelerate or
   Lightning fp16 owner also stands (they fill the "auto" in); elsewhere it is information.
4. On one path, sites of one framework (DeepSpeed, Trainer, accelerate, Lightning, apex) are
   one state machine (the code and its config, or alternative configs); a Trainer, accelerate
   or Lightning site that hands fp16 to DeepSpeed (`deepspeed=`, `distributed_type: DEEPSPEED`,
   a deepspeed strategy) is the DeepSpeed state machine; sites in exclusive arms of one `if` in
   one file are alternatives. Two GradScalers, or a GradScaler and any other owner, are two.
5. Two or more state machines on one training path: `double-scaling` error. Otherwise, owners
   of different frameworks on separate training paths: one `double-scaling` warning naming them
   (a launcher the scan does not see may still combine them). Owners of one framework on
   separate paths (two scripts, each with its own GradScaler) are fine.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ampdoctor.core.enums import RungId
from ampdoctor.core.findings import Finding, Location
from ampdoctor.kinds.double_scaling import (
    OwnersApart,
    OwnersOnOnePath,
    Untold,
    owners_apart,
    owners_on_one_path,
)
from ampdoctor.scan.graph import Graph
from ampdoctor.scan.precision_agreement import trainer_deepspeed_mismatch
from ampdoctor.scan.sites import DELEGATING_FRAMEWORKS, SINGLETON_FRAMEWORKS, FileScan, Site

RUNG = RungId.DOUBLE_SCALING


def _exclusive(a: tuple, b: tuple) -> bool:
    arms = dict(a)
    return any(bid in arms and arms[bid] != arm for bid, arm in b)


def _same_machine(a: Site, b: Site) -> bool:
    if a.file == b.file and a.line == b.line and a.kind == b.kind:
        return True
    if a.framework == b.framework and a.framework in SINGLETON_FRAMEWORKS:
        return True
    pair = {a.framework, b.framework}
    if "deepspeed" in pair:
        other = b if a.framework == "deepspeed" else a
        if other.framework in DELEGATING_FRAMEWORKS and other.delegates:
            return True
    return a.file == b.file and _exclusive(a.branch, b.branch)


def _representative(group: list[Site]) -> Site:
    deepspeed = [s for s in group if s.framework == "deepspeed"]
    pool = deepspeed or group
    return sorted(pool, key=Site.sort_key)[0]


def machines(owners: list[Site]) -> list[list[Site]]:
    """Partition the owners of one path into state machines (union-find, owners are few)."""
    parent = list(range(len(owners)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(owners)):
        for j in range(i + 1, len(owners)):
            if _same_machine(owners[i], owners[j]):
                parent[find(i)] = find(j)
    classes: dict[int, list[Site]] = defaultdict(list)
    for i, site in enumerate(owners):
        classes[find(i)].append(site)
    out = []
    for group in classes.values():
        rep = _representative(group)
        out.append([rep] + sorted((s for s in group if s is not rep), key=Site.sort_key))
    out.sort(key=lambda g: g[0].sort_key())
    return out


def machine_dict(group: list[Site]) -> dict[str, Any]:
    data = group[0].to_dict()
    if len(group) > 1:
        data["also_at"] = [s.to_dict() for s in group[1:]]
    return data


def _describe(group: list[Site], base: str | None) -> str:
    rep = group[0]
    text = f"{rep.kind} at {rep.where(base)}"
    if len(group) > 1:
        text += " (with " + ", ".join(f"{s.kind} at {s.where(base)}" for s in group[1:]) + ")"
    return text


class Decision:
    def __init__(self) -> None:
        self.owners: list[Site] = []
        self.infos: list[Site] = []
        self.groups: list[dict[str, Any]] = []
        self.findings: list[Finding] = []


def decide(scans: dict[str, FileScan], graph: Graph, base: str | None) -> Decision:
    sites = [s for scan in scans.values() if not scan.skipped for s in scan.sites]
    for uid, site in enumerate(sites):
        site.uid = uid
    kept = _training_paths(sites, graph)
    _promote_uses(sites, kept)
    activated = _activate_auto(sites, kept, base)

    def is_owner(site: Site) -> bool:
        return site.role == "owner" or (site.role == "possible" and site.uid in activated)

    decision = Decision()
    decision.owners = sorted((s for s in sites if is_owner(s)), key=Site.sort_key)
    decision.infos = sorted(
        (s for s in sites if not is_owner(s) and s.role in ("info", "possible")), key=Site.sort_key
    )
    all_machines, entries_of = _same_path_findings(decision, kept, is_owner, base)
    decision.findings += trainer_deepspeed_mismatch(kept, base)
    if not decision.findings and all_machines:
        _separate_paths_warning(decision, all_machines, entries_of, base)
    return decision


#: A training path: its entry point, the sites on it, and their uids.
_Path = tuple[str, list[Site], frozenset[int]]


def _training_paths(sites: list[Site], graph: Graph) -> list[_Path]:
    """The training paths that hold a relevant site, with their sites; a path whose sites all
    stand on a larger path is dropped (it says nothing new)."""
    by_file: dict[str, list[Site]] = defaultdict(list)
    for site in sites:
        by_file[site.file].append(site)
    relevant = {
        s.file for s in sites
        if s.role in ("owner", "possible", "use") or s.framework == "gradscaler"
        or (s.delegates and s.precision)
    }
    raw_paths = graph.paths(relevant)
    path_sites: list[tuple[str, list[Site]]] = []
    for entry, files in raw_paths:
        found = [s for f in sorted(files) for s in by_file.get(f, ())]
        if found:
            path_sites.append((entry, found))
    # keep the largest site sets only (a path inside another path says nothing new)
    path_sites.sort(key=lambda p: (-len(p[1]), p[0]))
    kept: list[_Path] = []
    for entry, found in path_sites:
        ids = frozenset(s.uid for s in found)
        if any(ids <= other for _, _, other in kept):
            continue
        kept.append((entry, found, ids))
    return kept


def _promote_uses(sites: list[Site], kept: list[_Path]) -> None:
    """Rule 2: uses of a GradScaler built on the same path are that GradScaler; a use whose
    GradScaler is built nowhere in the scanned files becomes an owner (once per file and
    receiver)."""
    covered: set[int] = set()
    for _, found, _ in kept:
        if any(s.framework == "gradscaler" and s.role in ("owner", "info") for s in found):
            covered.update(s.uid for s in found if s.role == "use")
    promoted: dict[tuple[str, str], Site] = {}
    for site in sites:
        if site.role != "use" or site.uid in covered:
            continue
        key = (site.file, site.ref)
        if key in promoted:
            site.role = "duplicate-use"
            continue
        promoted[key] = site
        site.role = "owner"
        site.detail += "; the GradScaler itself is built outside the scanned files"


def _activate_auto(sites: list[Site], kept: list[_Path], base: str | None) -> dict[int, Site]:
    """Rule 3: "auto" becomes an owner where a framework fp16 owner shares the path; returns
    the uid of each such site with the owner that fills it in."""
    activated: dict[int, Site] = {}
    for _, found, _ in kept:
        enabler = next(
            (s for s in found if s.role == "owner" and s.framework in DELEGATING_FRAMEWORKS), None
        )
        if enabler is None:
            continue
        for site in found:
            if site.role == "possible" and site.uid not in activated:
                activated[site.uid] = enabler
    for uid, enabler in activated.items():
        site = sites[uid]
        site.detail += f"; filled in as fp16 by {enabler.kind} at {enabler.where(base)}"
    return activated


def _same_path_findings(
    decision: Decision,
    kept: list[_Path],
    is_owner: Callable[[Site], bool],
    base: str | None,
) -> tuple[dict[int, list[Site]], dict[int, list[str]]]:
    """Rule 5, one path: the groups of each path, and an error for each distinct set of two or
    more state machines on one path. Returns every state machine met (by its first site's
    uid) and the entry points each stands on."""
    errors_seen: set[frozenset[int]] = set()
    all_machines: dict[int, list[Site]] = {}
    entries_of: dict[int, list[str]] = defaultdict(list)
    for entry, found, _ in kept:
        owners = [s for s in found if is_owner(s)]
        if not owners:
            continue
        groups = machines(owners)
        decision.groups.append(
            {
                "entry": entry,
                "owners": [machine_dict(g) for g in groups],
                "measured": len(groups),
                "double_scaling": len(groups) > 1,
            }
        )
        for group in groups:
            all_machines.setdefault(group[0].uid, group)
            if entry not in entries_of[group[0].uid]:
                entries_of[group[0].uid].append(entry)
        if len(groups) < 2:
            continue
        key = frozenset(g[0].uid for g in groups)
        if key in errors_seen:
            continue
        errors_seen.add(key)
        decision.findings.append(same_path_finding([machine_dict(g) for g in groups], entry, base))
    return all_machines, entries_of


def _owner_text(owner: dict[str, Any], base: str | None) -> str:
    from ampdoctor.scan.sites import display_path

    text = f"{owner['kind']} at {display_path(owner['file'], base)}"
    if owner.get("line") is not None:
        text += f":{owner['line']}"
    if owner.get("key_path"):
        text += f" ({owner['key_path']})"
    return text


def describe_owner(owner: dict[str, Any], base: str | None) -> str:
    """`GradScaler at train.py:12` (with the sites of the same state machine) for messages."""
    text = _owner_text(owner, base)
    if owner.get("also_at"):
        text += " (with " + ", ".join(_owner_text(o, base) for o in owner["also_at"]) + ")"
    return text


def same_path_finding(owners: list[dict[str, Any]], entry: str, base: str | None,
                      met: str = "", untold: Untold | None = None) -> Finding:
    """The rule-5 error for two or more state machines (`machine_dict`s) on the path of
    `entry`, located at the one to remove; `met` ends the message (what a run saw them share),
    `untold` makes it a warning (why the runs could not tell)."""
    first = owners[_to_remove_index([o["kind"] for o in owners])]
    return owners_on_one_path(OwnersOnOnePath(
        RUNG, tuple(owners), entry, entry_shown=_short(entry, base),
        owners_shown=tuple(describe_owner(o, base) for o in owners), met=met, untold=untold,
        location=Location(file=first["file"], line=first.get("line") or 1)))


def _separate_paths_warning(
    decision: Decision,
    all_machines: dict[int, list[Site]],
    entries_of: dict[int, list[str]],
    base: str | None,
) -> None:
    """Rule 5, separate paths: owners of different frameworks on separate training paths give
    one warning naming them all."""
    groups = sorted(all_machines.values(), key=lambda g: g[0].sort_key())
    frameworks = {g[0].framework for g in groups}
    if len(frameworks) <= 1:
        return
    first = _to_remove(groups)
    decision.findings.append(owners_apart(OwnersApart(
        RUNG, tuple(machine_dict(g) for g in groups),
        shown=tuple((_describe(g, base), tuple(_short(e, base) for e in entries_of[g[0].uid]))
                    for g in groups),
        entries=tuple({e for g in groups for e in entries_of[g[0].uid]}),
        location=Location(file=first.file, line=first.line or 1))))


def _short(path: str, base: str | None) -> str:
    from ampdoctor.scan.sites import display_path

    return display_path(path, base)


#: Which owner a finding points at: the one a user should remove. A hand-written static scale
#: before a GradScaler; a hand-written GradScaler before a framework's own loss scaling
#: (DeepSpeed, Trainer, accelerate, Lightning own the loop they run).
_REMOVE_FIRST = {"static loss scale": 0, "GradScaler": 1}


def _to_remove_index(kinds: list[str]) -> int:
    return min(range(len(kinds)), key=lambda i: (_REMOVE_FIRST.get(kinds[i], 2), i))


def _to_remove(groups: list[list[Site]]) -> Site:
    return groups[_to_remove_index([g[0].kind for g in groups])][0]
