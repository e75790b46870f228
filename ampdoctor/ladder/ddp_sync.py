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

from .. import deciders, thresholds
from ..ddp import launch
from ..deciders import Observed
from ..enums import RungId, Severity, Status
from ..errors import LaunchError
from ..evidence import Evidence
from ..findings import Finding, Location, RungResult, conclude, location
from ..kinds.loop_error import RankRaised, RanksHung, rank_raised, ranks_hung
from ..probe.callsite import Site
from ..spec import to_wire

RUNG = RungId.DDP_SYNC

#: How each wrapper names its gradient sync and the switch that turns it off.
WORDS = {
    "ddp": {"who": "DDP", "verb": "all-reduced", "noun": "all-reduce",
            "switch": "model.no_sync() (or require_backward_grad_sync = False)",
            # where a backward's gradient goes when it does not sync
            "unsynced": "stayed rank-local and out of the window's update"},
    "fsdp": {"who": "FSDP", "verb": "reduce-scattered", "noun": "reduce-scatter",
             "switch": "model.set_requires_gradient_sync(False)",
             "unsynced": "stayed in FSDP's unsharded accumulated gradient, out of this "
                         "window's update, and was carried into the next window's "
                         "reduce-scatter: every update after the first holds the previous "
                         "window's last micro-batch(es) instead of its own"},
}
WORDS["hsdp"] = {**WORDS["fsdp"], "who": "HSDP"}
#: the loop's DeepSpeed engine communicates itself: its collectives are its config's business
#: (not counted); what every rank's engine consumed is judged
WORDS["deepspeed"] = {"who": "DeepSpeed", "verb": "reduced", "noun": "gradient reduction",
                      "switch": "(the engine's own accumulation boundary)",
                      "unsynced": "stayed rank-local"}
#: the wrappers whose communication the rung does not count
ENGINES = ("DeepSpeed",)
#: the wrappers whose gradient sync reduces into sharded gradients (FSDP2's fully_shard)
SHARDED = ("FSDP", "HSDP")


def _loc(site: list[Any] | None) -> Location | None:
    """A rank's [file, line, function] as a Location, its code read like every probe site's."""
    if not site or site[0] is None:
        return None
    return location(Site(site[0], site[1], site[2] if len(site) > 2 else None))


def _uneven(session, world_size: int) -> str | None:
    for index, mb in enumerate(session.micro_batches):
        tensors = list(mb.values()) if isinstance(mb, dict) else list(mb)
        sizes = {t.shape[0] for t in tensors if t.dim() > 0}
        if any(n % world_size for n in sizes):
            return (f"micro-batch {index} ({min(sizes)} samples) does not split evenly over "
                    f"{world_size} ranks")
    return None


def _run_ranks(session, world_size: int, timeout_s: float) -> dict[int, dict[str, Any]]:
    spec_path = to_wire(session.spec)
    if launch.GROUP is not None:
        return launch.GROUP.run_ranks(spec_path, timeout_s)
    return launch.run_spawned(spec_path, world_size, timeout_s)


def _rank_error(results: dict[int, dict[str, Any]], world_size: int, timeout_s: float,
                finder) -> RungResult | None:
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
    """More syncing backwards than optimizer steps: the finding its decider makes of the
    volume, or None where the volume is not the story (FSDP2 syncing on every window's last
    backward too, whose update is off for another reason: the consumed gradient says which)."""
    total_bytes = sum(n for _, n in r0["buckets"])
    per_step = len(synced) / windows
    last_missed = [w for w in range(windows) if (w + 1) * per_window not in synced]
    if sharded and not update_right and not last_missed:
        return None
    extra = next((b for b, p in zip(synced, positions, strict=False) if p != per_window),
                 synced[0])
    where = _loc(r0["no_syncs"][0][0]) if r0["no_syncs"] else _loc(r0["backwards"][extra - 1])
    volume = (f"{words['who']} {words['verb']} gradients on {len(synced)} of "
              f"{len(r0['backwards'])} backward passes for {windows} optimizer steps "
              f"({per_step:.3g} per step): {total_bytes / windows:,.0f} bytes per window "
              f"against the {one_sync_bytes:,} a single sync needs.")
    evidence: Evidence = {
        "measured": round(per_step, 6), "expected": 1.0,
        "bytes_per_window": round(total_bytes / windows),
        "minimum_bytes_per_window": one_sync_bytes, "world_size": world_size}
    if sharded:
        evidence["reduce_scatters_per_window"] = round(per_step, 6)
    else:
        evidence["allreduces_per_window"] = round(per_step, 6)
    fix = ""
    if sharded and update_right:
        # FSDP2's sync-every-micro-batch mode: each backward reduce-scatters its gradient into
        # the sharded .grad and frees the unsharded one; with set_requires_gradient_sync(False)
        # the unsharded gradient (one reduce-scatter's input) is held over the window instead.
        evidence["unsharded_gradient_bytes_not_held"] = one_sync_bytes
        evidence["max_relative_error"] = round(worst, 9)
        message = (volume + " The update is right (every rank's consumed gradient matched the "
                   f"reference, max relative error {worst:.2g}): this is FSDP2's documented "
                   "sync-on-every-micro-batch mode, a trade. It costs "
                   f"{per_step:.3g}x the gradient communication of one {words['noun']} per "
                   f"window; it saves holding the unsharded gradient accumulated over the "
                   f"window, about {one_sync_bytes:,} bytes per rank (estimated: one "
                   f"{words['noun']}'s input), between micro-batches.")
        fix = ("Keep it if memory is what limits you. Otherwise switch sync off for the first "
               f"K-1 micro-batches of each window ({words['switch']}, on again before the "
               "last forward) for one reduce-scatter per optimizer step.")
    elif last_missed:
        message = (volume + f" The window's last backward did not sync (window(s) "
                   f"{', '.join(map(str, last_missed))}): its gradient {words['unsynced']}.")
    else:
        message = volume + (
            " no_sync() was entered, but after the forward: DDP decides in forward() whether "
            "the backward all-reduces, so the context must hold the forward too."
            if r0["no_syncs"] else
            f" The first K-1={per_window - 1} micro-batches of each window need "
            f"{words['switch']}.")
    return deciders.sync_on_every_micro_batch(
        Observed(RUNG, Severity.ERROR, message, evidence=evidence, location=where, fix=fix),
        sharded=sharded, update_right=update_right and not last_missed)


def _replicas_not_reduced(r0: dict[str, Any], windows: int, per_window: int,
                          missed: list[int], evidence: Evidence) -> Finding:
    """HSDP reduce-scattered inside each node, but a window's last backward did not all-reduce
    across the replicas: FSDP2 holds a reduce-scatter's output aside until the next all-reduce."""
    reduced = sorted(set(r0["replica_reduces"]))
    toggles = r0.get("all_reduce_toggles") or []
    where = next((_loc(t[1]) for t in toggles if t[1]), None) or _switch_site(r0)
    numbers: Evidence = {"replica_all_reduces": len(reduced), "windows_not_all_reduced": missed,
                         **evidence}
    if not reduced:
        stepped = sum(1 for s in r0["judged"] if s["ratio"] > 0)
        return deciders.gradient_mismatch(Observed(RUNG, Severity.ERROR,
            "HSDP reduce-scattered inside each node but never all-reduced across the "
            "replicas (set_requires_all_reduce(False), never turned back on): FSDP2 holds each "
            "reduce-scatter's output aside until an all-reduce, so the sharded .grad stayed "
            f"None and no rank stepped at all (rank 0 consumed a gradient at {stepped} of its "
            f"{len(r0['judged'])} optimizer steps).",
            evidence={"measured": 0, "expected": windows, "steps_with_a_gradient": stepped,
                      **numbers},
            location=where,
            fix="Turn the all-reduce back on for the last micro-batch of every window, before "
                "its forward: model.set_requires_all_reduce(i % K == K - 1)."))
    position = ((reduced[0] - 1) % per_window) + 1
    return deciders.missing_no_sync(Observed(RUNG, Severity.ERROR,
        f"HSDP all-reduced across the replicas on backward {position} of {per_window}, not the "
        "window's last (window(s) " + ", ".join(map(str, missed)) + "): the later "
        "micro-batches' reduce-scattered gradients were held aside and carried into the next "
        "window's all-reduce, out of this window's update.",
        evidence={"measured": position, "expected": per_window, **numbers},
        location=where))


def run(session) -> RungResult:
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


def _judge(session, results: dict[int, dict[str, Any]], world_size: int,
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
    evidence: Evidence = {"rank": rank, "step": r["judged"].index(first) if first else None,
                "ratio": first and round(first["ratio"], 6),
                "cosine": first and round(first["cosine"], 6),
                "relative_error": first and round(first["relative_error"], 6),
                "max_gradient_difference_between_ranks": round(max(diffs, default=0.0), 6),
                "first_step_ranks_differ": apart[0] if apart else None,
                "parameter_difference_between_ranks": r0.get("parameter_difference"),
                "world_size": world_size}
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
    if first and ratio != first["ratio"]:
        evidence["ratio_before_clip"] = round(ratio, 6)
    if not synced_backwards and not engine:
        stepped = sum(1 for s in r0["judged"] if s["ratio"] > 0)
        what = (f"sync was never turned back on, so the sharded .grad stayed None on every "
                f"rank and no rank stepped at all: rank 0 consumed a gradient at {stepped} of "
                f"its {len(r0['judged'])} optimizer steps (the optimizer skips a parameter "
                "without a gradient) and the weights never moved, while each rank's unsharded "
                "gradient kept accumulating unseen." if sharded else
                "so each rank stepped on its own shard and the ranks' parameters ended "
                f"{r0.get('parameter_difference', 0):.3g} apart (relative).")
        finding = deciders.gradient_mismatch(Observed(RUNG, Severity.ERROR,
            f"{words['who']} never {words['verb']} a gradient: every backward ran with "
            f"{words['switch']}; {what}",
            evidence={"measured": 0, "expected": windows, "steps_with_a_gradient": stepped,
                      **evidence},
            location=_switch_site(r0),
            fix=("Turn sync back on for the last micro-batch of every window, before its "
                 "forward: model.set_requires_gradient_sync(i % K == K - 1)." if sharded
                 else "")))
    elif wrong_position:
        finding = deciders.missing_no_sync(Observed(RUNG, Severity.ERROR,
            f"{words['who']} {words['verb']} once per window, but on backward "
            f"{wrong_position[0]} of {per_window}, not the last: the later micro-batches' "
            f"gradients {words['unsynced']}. "
            + (f"The ranks consumed gradients {max(diffs, default=0.0):.3g} apart (relative, "
               f"first at step {evidence['first_step_ranks_differ']}) and their parameters "
               f"ended {r0.get('parameter_difference', 0):.3g} apart." if apart else
               f"Rank {rank} consumed {first['ratio']:.4g}x the reference gradient of the "
               f"global batch (cosine {first['cosine']:.4f}) at step {evidence['step']}."),
            evidence={"measured": wrong_position[0], "expected": per_window,
                      "synced_backward_in_window": positions, **evidence},
            location=_switch_site(r0) or _loc(r0["backwards"][synced_backwards[0] - 1])))
    elif hsdp_missed:
        finding = _replicas_not_reduced(r0, windows, per_window, hsdp_missed, evidence)
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
        how = (f" Rank 0 and rank {other['rank']} part ways at {parted[0]} "
               f"({parted[1][0]}:{parted[1][1]})." if parted and parted[1] else "")
        finding = deciders.gradient_mismatch(Observed(RUNG, Severity.ERROR,
            f"The ranks consumed different gradients ({max(diffs):.3g} apart, relative, first "
            f"at step {apart[0]}) although {words['who']} {words['verb']} once per window on "
            "its last backward: something in the loop is rank-dependent (a clip, a scale or a "
            "branch on the rank), so the ranks' parameters drift apart "
            f"({r0.get('parameter_difference', 0):.3g} after the run).{how}",
            evidence={"measured": round(max(diffs), 6), "expected": 0.0, **evidence},
            location=where))
    elif (first and abs(ratio * world_size - 1) <= thresholds.WORLD_SIZE_RATIO_RTOL
          and first["cosine"] > thresholds.WORLD_SIZE_MIN_COSINE):
        finding = deciders.double_average(Observed(RUNG, Severity.ERROR,
            f"Every rank consumed {ratio:.4g}x the reference gradient of the global "
            f"batch: 1/world_size (={1 / world_size:g}). {words['who']} already averages "
            "gradients over "
            "the ranks; the loss is divided by the world size on top of that.",
            evidence={"measured": round(ratio, 6), "expected": 1.0, **evidence},
            location=_loc(r["backwards"][0]) if r["backwards"] else None))
    else:
        # The ranks agree and synced right, but their update is off the reference in another
        # shape: the rank's own rules named it (compare_trace explains every first bad step).
        data = dict(r["findings"][0])
        data["rung"] = RUNG
        data["location"] = Location(**data["location"]) if data.get("location") else None
        data["evidence"] = {**data.get("evidence", {}), "rank": rank, "world_size": world_size}
        finding = deciders.from_dict(data)
    return conclude(RUNG, [finding], "", details)

