"""Rung `ddp-sync`: every rank consumes the gradient of the global batch, synchronised once per
optimizer step, on the window's last backward (article §§1, 10, 13).

The ranks (`ampdoctor.ddp.launch`: spawned here, or the processes of a torchrun launch) run the
user's loop in fp32 on their shards of every micro-batch, each judged against the reference over
the whole window (`ampdoctor.ddp.rank`). Here the rung reads what they brought back:

1. the communication: more all-reducing backwards than windows is `missing-no-sync` (K times
   the bytes), whatever the gradients say -- that consequence is the communication itself;
2. the consumed gradients: every rank must match the reference and rank 0. A mismatch is
   explained by the sync pattern (a sync on a backward other than the window's last:
   `missing-no-sync`), by the 1/world_size factor (`double-average`), or by the same rules as
   the single-process rungs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core import thresholds
from ..core.enums import RungId, Status
from ..core.errors import LaunchError
from ..core.findings import Finding, Location, RungResult, conclude, location
from ..ddp import launch
from ..kinds import from_dict
from ..kinds.accumulation import DividedByWorldSize, divided_by_world_size
from ..kinds.loop_error import RankRaised, RanksHung, rank_raised, ranks_hung
from ..kinds.mismatch import (
    NeverSynced,
    RanksApart,
    ReplicasNeverAllReduced,
    never_synced,
    ranks_apart,
    replicas_never_all_reduced,
)
from ..kinds.sync import (
    WORDS,
    RanksCompared,
    ReplicasAllReducedLate,
    SyncOnWrongBackward,
    TooManySyncs,
    replicas_all_reduced_late,
    sync_on_wrong_backward,
    too_many_syncs,
)
from ..probe.callsite import Site
from ..spec import to_wire

RUNG = RungId.DDP_SYNC

#: the wrappers whose communication the rung does not count
ENGINES = ("DeepSpeed",)
#: the wrappers whose gradient sync reduces into sharded gradients (FSDP2's fully_shard)
SHARDED = ("FSDP", "HSDP")


def _loc(site: list[Any] | None) -> Location | None:
    """A rank's [file, line, function] as a Location, its code read like every probe site's."""
    if not site or site[0] is None:
        return None
    return location(Site(site[0], site[1], site[2] if len(site) > 2 else None))


def _uneven(session: Any, world_size: int) -> str | None:
    for index, mb in enumerate(session.micro_batches):
        tensors = list(mb.values()) if isinstance(mb, dict) else list(mb)
        sizes = {t.shape[0] for t in tensors if t.dim() > 0}
        if any(n % world_size for n in sizes):
            return (f"micro-batch {index} ({min(sizes)} samples) does not split evenly over "
                    f"{world_size} ranks")
    return None


def _run_ranks(session: Any, world_size: int, timeout_s: float) -> dict[int, dict[str, Any]]:
    spec_path = to_wire(session.spec)
    if launch.GROUP is not None:
        return launch.GROUP.run_ranks(spec_path, timeout_s)
    return launch.run_spawned(spec_path, world_size, timeout_s)


def _rank_error(results: dict[int, dict[str, Any]], world_size: int, timeout_s: float,
                finder: Any) -> RungResult | None:
    errors = [r for r in results.values() if r.get("error")]
    launch_errors = [r for r in errors if r.get("stage") == "launch"]
    if launch_errors:
        err = launch_errors[0]
        raise LaunchError(f"rank {err['rank']} of the {world_size}-process DDP run could not "
                          f"start: {err['error']}")
    if errors:
        # The first error is the cause: a peer that lost the raising rank fails after it, in
        # a collective ("Connection reset by peer").
        err = min(errors, key=lambda r: (r.get("error_time", float("inf")), r["rank"]))
        where = _loc(err.get("error_site"))
        return RungResult(RUNG, Status.FAIL, f"the loop raised on rank {err['rank']} under DDP", [
            rank_raised(RankRaised(RUNG, err["rank"], world_size, err["error"],
                                   location=where))])
    missing = sorted(set(range(world_size)) - {r for r, v in results.items() if not v.get("hung")})
    if not missing:
        return None
    unjoined = [r for r in missing if results.get(r, {}).get("stage") == "launch"]
    if unjoined:
        raise LaunchError(f"rank(s) {', '.join(map(str, unjoined))} of the {world_size}-process "
                          f"DDP run could not join its process group within ddp.timeout_s = "
                          f"{timeout_s:g} s (a master address the ranks cannot reach, or a "
                          "firewall)")
    # Where each stopped rank was: in the user's code (the hang), or past its loop, in
    # ampdoctor's gather, waiting for the others.
    sites = {r: finder.from_stack_dump(results.get(r, {}).get("stack", "")) for r in missing}
    in_loop = [r for r in missing if sites[r] is not None]
    waiting = [r for r in missing if sites[r] is None]
    site = sites[in_loop[0]] if in_loop else None
    return RungResult(RUNG, Status.FAIL, f"the DDP run did not finish within {timeout_s:g} s", [
        ranks_hung(RanksHung(RUNG, world_size, timeout_s, tuple(in_loop), tuple(waiting),
                             tuple(missing), location=location(site)))])


def _window_positions(synced: list[int], backwards: int,
                      windows: int) -> tuple[list[int], int]:
    """The 1-based position in its window of every backward that synced (`synced`: their
    ordinals), and the number of backwards per window."""
    per_window = max(1, round(backwards / max(windows, 1)))
    return [((b - 1) % per_window) + 1 for b in synced], per_window


def _first_difference(a: list[list[Any]], b: list[list[Any]]) -> tuple[str, list[Any]] | None:
    """The first call where two ranks' call sequences differ: (what, its site)."""
    for x, y in zip(a, b, strict=False):   # the shorter one's calls
        if x != y:
            call = x if x[1] else y
            return (f"a {call[0]} call that only one of them makes" if x[0] != y[0]
                    else f"{call[0]}", call[1:])
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        call = longer[min(len(a), len(b))]
        return f"a {call[0]} call that only one of them makes", call[1:]
    return None


def _switch_site(r0: dict[str, Any]) -> Location | None:
    """Where the loop switches sync: its require_backward_grad_sync (or FSDP's
    set_requires_gradient_sync) line, else its no_sync()."""
    for entries in (r0["toggles"], r0["no_syncs"]):
        for entry in entries:
            site = entry[1] if entries is r0["toggles"] else entry[0]
            if site:
                return _loc(site)
    return None


def _too_many_syncs(r0: dict[str, Any], words: dict[str, str], windows: int,
                    synced: list[int], positions: list[int], per_window: int,
                    one_sync_bytes: int, world_size: int, sharded: bool, update_right: bool,
                    worst: float) -> Finding | None:
    """More syncing backwards than optimizer steps: the finding its unit makes of the
    volume, or None where the volume is not the story (FSDP2 syncing on every window's last
    backward too, whose update is off for another reason: the consumed gradient says which)."""
    last_missed = [w for w in range(windows) if (w + 1) * per_window not in synced]
    if sharded and not update_right and not last_missed:
        return None
    extra = next((b for b, p in zip(synced, positions, strict=False) if p != per_window),
                 synced[0])
    where = _loc(r0["no_syncs"][0][0]) if r0["no_syncs"] else _loc(r0["backwards"][extra - 1])
    return too_many_syncs(TooManySyncs(
        RUNG, words["who"], synced=len(synced), backwards=len(r0["backwards"]),
        windows=windows, per_window=per_window,
        total_bytes=sum(n for _, n in r0["buckets"]), one_sync_bytes=one_sync_bytes,
        world_size=world_size, sharded=sharded, update_right=update_right, worst=worst,
        last_missed=tuple(last_missed), no_sync_entered=bool(r0["no_syncs"]), location=where))


def _replicas_not_reduced(r0: dict[str, Any], windows: int, per_window: int,
                          missed: list[int], ranks: RanksCompared) -> Finding:
    """HSDP reduce-scattered inside each node, but a window's last backward did not all-reduce
    across the replicas: FSDP2 holds a reduce-scatter's output aside until the next all-reduce."""
    reduced = sorted(set(r0["replica_reduces"]))
    toggles = r0.get("all_reduce_toggles") or []
    where = next((_loc(t[1]) for t in toggles if t[1]), None) or _switch_site(r0)
    if not reduced:
        return replicas_never_all_reduced(ReplicasNeverAllReduced(
            RUNG, windows=windows, missed=tuple(missed),
            stepped=sum(1 for s in r0["judged"] if s["ratio"] > 0),
            steps_judged=len(r0["judged"]), ranks=ranks, location=where))
    return replicas_all_reduced_late(ReplicasAllReducedLate(
        RUNG, position=((reduced[0] - 1) % per_window) + 1, per_window=per_window,
        missed=tuple(missed), replica_all_reduces=len(reduced), ranks=ranks, location=where))


def run(session: Any) -> RungResult:
    spec = session.spec
    group = launch.GROUP
    if spec.ddp is None and group is None:
        return RungResult(RUNG, Status.SKIP, "no `ddp` in the spec")
    world_size = group.world_size if group is not None else spec.ddp.world_size
    timeout_s = spec.ddp.timeout_s if spec.ddp is not None else launch.DEFAULT_TIMEOUT_S
    if world_size < 2:
        return RungResult(RUNG, Status.SKIP, "ddp.world_size is 1: there is nothing to synchronise")
    uneven = _uneven(session, world_size)
    if uneven:
        return RungResult(RUNG, Status.SKIP, uneven)
    results = _run_ranks(session, world_size, timeout_s)
    failed = _rank_error(results, world_size, timeout_s, session.finder)
    if failed is not None:
        return dataclasses.replace(failed, details={
            **failed.details, "world_size": world_size,
            "launch": "torchrun" if launch.GROUP else "spawned"})
    wrapper = spec.ddp.wrapper if spec.ddp is not None else "ddp"
    if wrapper != "deepspeed" and results[0].get("engine_built"):
        # our DDP (or FSDP) around a model the loop hands to DeepSpeed: two communicators,
        # whose extra all-reduces would be judged as the loop's
        return RungResult(RUNG, Status.SKIP, (
            f"the loop builds a DeepSpeed engine, which does its own communication, inside "
            f"ampdoctor's {WORDS[wrapper]['who']} wrapper: set `ddp: {{wrapper: deepspeed}}` "
            "so each rank's loop gets the model itself and the engine's update is judged"),
            details={"world_size": world_size, "wrapper": WORDS[wrapper]["who"]})
    return _judge(session, results, world_size, WORDS[wrapper])


def _judge(session: Any, results: dict[int, dict[str, Any]], world_size: int,
           words: dict[str, str]) -> RungResult:
    sharded = words["who"] in SHARDED
    r0 = results[0]
    windows = len(r0["judged"]) or len(r0["steps"]) or session.N
    total_bytes = sum(n for _, n in r0["buckets"])
    synced_backwards = sorted({b for b, _ in r0["buckets"]})
    positions, per_window = _window_positions(synced_backwards, len(r0["backwards"]), windows)
    one_sync_bytes = sum(n for b, n in r0["buckets"]
                         if synced_backwards and b == synced_backwards[-1])
    details: dict[str, Any] = {
        "world_size": world_size, "launch": "torchrun" if launch.GROUP else "spawned",
        "wrapper": words["who"],
        "syncing_backwards": synced_backwards, "backwards_per_window": per_window,
        "sync_position_in_window": positions, "bytes_communicated": total_bytes,
        "optimizer_steps": len(r0["steps"]),
        # every rank's consumed update against the reference of the global batch
        "steps_compared": len(r0["judged"]),
        "gradient_difference_between_ranks": r0.get("gradient_difference", []),
        "parameter_difference_between_ranks": r0.get("parameter_difference"),
        "dropout": "off on the ranks and in the reference",
        # sharded (FSDP2): each rank judged its own piece of every gradient, summing scalars
        "shard_wise": bool(r0.get("shard_wise")), "device_mesh": r0.get("mesh"),
        "replica_all_reduces": sorted(set(r0.get("replica_reduces", []))),
        "comparison_bytes_per_rank": [results[k].get("comparison_bytes", {}).get("total")
                                      for k in sorted(results)]}
    tol = r0.get("tolerance", thresholds.RANKS_APART_RTOL)

    # what every rank consumed, against the reference and each other
    bad_ranks = {rank: r for rank, r in results.items() if any(s["bad"] for s in r["judged"])}
    diffs = r0.get("gradient_difference", [])
    apart = [i for i, d in enumerate(diffs) if d > tol]
    worst = max((s["relative_error"] for r in results.values() for s in r["judged"]), default=0.0)
    update_right = not bad_ranks and not apart

    engine = words["who"] in ENGINES
    if engine:
        details["communication"] = f"{words['who']}'s engine (not counted)"
    # 1. the communication volume
    if len(synced_backwards) > windows and not engine:
        volume = _too_many_syncs(r0, words, windows, synced_backwards, positions, per_window,
                                 one_sync_bytes, world_size, sharded, update_right, worst)
        if volume is not None:
            return conclude(RUNG, [volume], "", details)

    # 2. what every rank consumed
    if update_right and engine:
        return conclude(RUNG, [], f"{words['who']}'s engine did the communication over "
                        f"{world_size} ranks; every rank consumed the reference gradient of the "
                        f"global batch ({windows} steps, max relative error {worst:.2g})",
                        details)
    if update_right:
        return conclude(RUNG, [], f"one gradient {words['noun']} per optimizer step, on the "
                        "window's "
                        f"last backward, over {world_size} ranks; every rank consumed the "
                        f"reference gradient of the global batch ({windows} steps, max relative "
                        f"error {worst:.2g})", details)
    rank, r = min(bad_ranks.items()) if bad_ranks else (0, r0)
    first: Any = next((s for s in r["judged"] if s["bad"]),
                      r["judged"][apart[0]] if apart else None)
    # HSDP: the windows whose last backward did not all-reduce across the replicas
    replica_reduced = set(r0.get("replica_reduces", []))
    hsdp_missed = ([w for w in range(windows) if (w + 1) * per_window not in replica_reduced]
                   if "replica_reduces" in r0 else [])
    # (several syncs per window: the one that matters is the window's last backward's)
    wrong_position = ([p for p in positions if p != per_window]
                      if len(synced_backwards) <= windows and not engine else [])
    # before a clip that bit: the factor a clip hides (the judge's pre-clip ratio)
    unclipped = r.get("first_bad_unclipped_ratio")
    ratio = (unclipped or first.get("preclip_ratio") or first["ratio"]) if first else 0.0
    ranks = RanksCompared(
        rank, step=r["judged"].index(first) if first else None,
        ratio=first["ratio"] if first else None, cosine=first["cosine"] if first else None,
        relative_error=first["relative_error"] if first else None,
        max_difference=max(diffs, default=0.0), first_apart=apart[0] if apart else None,
        parameter_difference=r0.get("parameter_difference"), world_size=world_size,
        ratio_before_clip=ratio if first and ratio != first["ratio"] else None)
    if not synced_backwards and not engine:
        finding = never_synced(NeverSynced(
            RUNG, words["who"], sharded=sharded, windows=windows,
            stepped=sum(1 for s in r0["judged"] if s["ratio"] > 0),
            steps_judged=len(r0["judged"]), ranks=ranks, location=_switch_site(r0)))
    elif wrong_position:
        finding = sync_on_wrong_backward(SyncOnWrongBackward(
            RUNG, words["who"], position=wrong_position[0], per_window=per_window,
            positions=tuple(positions), apart=bool(apart), ranks=ranks,
            location=_switch_site(r0) or _loc(r0["backwards"][synced_backwards[0] - 1])))
    elif hsdp_missed:
        finding = _replicas_not_reduced(r0, windows, per_window, hsdp_missed, ranks)
    elif apart:
        # One sync per window, on its last backward, yet the ranks consumed different
        # gradients: the loop does something per rank (a clip, a scale, a branch on rank).
        # Where their calls part ways is the line.
        other = next((results[k] for k in sorted(results) if k != 0), r0)
        parted = _first_difference(r0.get("calls", []), other.get("calls", []))
        explained = r0.get("findings") or other.get("findings") or []
        where = (_loc(parted[1]) if parted else
                 Location(**explained[0]["location"]) if explained and explained[0].get("location")
                 else _loc(r0["judged"][apart[0]]["site"]) if r0["judged"] else None)
        finding = ranks_apart(RanksApart(
            RUNG, words["who"], ranks, other_rank=other["rank"],
            parted=(parted[0], parted[1][0], parted[1][1]) if parted and parted[1] else None,
            location=where))
    elif (first and abs(ratio * world_size - 1) <= thresholds.WORLD_SIZE_RATIO_RTOL
          and first["cosine"] > thresholds.WORLD_SIZE_MIN_COSINE):
        finding = divided_by_world_size(DividedByWorldSize(
            RUNG, words["who"], ratio, ranks,
            location=_loc(r["backwards"][0]) if r["backwards"] else None))
    else:
        # The ranks agree and synced right, but their update is off the reference in another
        # shape: the rank's own rules named it (compare_trace explains every first bad step).
        data = dict(r["findings"][0])
        data["rung"] = RUNG
        data["location"] = Location(**data["location"]) if data.get("location") else None
        data["evidence"] = {**data.get("evidence", {}), "rank": rank, "world_size": world_size}
        finding = from_dict(data)
    return conclude(RUNG, [finding], "", details)

