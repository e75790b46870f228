"""The gradient synchronisation kind of DDP / FSDP: `missing-no-sync`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.enums import KindId, Severity
from ..core.evidence import Evidence
from ..core.findings import Finding, Location
from .base import Kind, Observed

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


def words_of(who: str) -> dict[str, str]:
    """The words of the wrapper a rung names `who` ("DDP", "FSDP", "HSDP", "DeepSpeed")."""
    return next(w for w in WORDS.values() if w["who"] == who)

MISSING_NO_SYNC = Kind(
    KindId.MISSING_NO_SYNC,
    title="DDP/FSDP synchronises gradients on the wrong micro-batches",
    why=(
        "Without `no_sync()` (or `require_backward_grad_sync = False`, or FSDP's "
        "`set_requires_gradient_sync(False)`) on the first K-1 micro-batches, DDP all-reduces K "
        "times per optimizer step: K times the communication for the same result. With the "
        "switch one micro-batch off (set after the forward, an off-by-one condition), the one "
        "sync of a window happens on another backward: the later micro-batches' gradients stay "
        "rank-local, the ranks consume different gradients and their parameters drift apart "
        "(under FSDP2 they are carried into the next window's update). Under FSDP2 a "
        "reduce-scatter on every micro-batch with a right update is a documented trade (K times "
        "the communication for not holding the unsharded accumulated gradient): a warning."),
    fix=(
        "Switch sync off for the first K-1 micro-batches and on for the last, *before* each "
        "forward: `with model.no_sync():` around forward and backward, or "
        "`model.require_backward_grad_sync = (micro_step == K - 1)` before the forward "
        "(FSDP2: `model.set_requires_gradient_sync(micro_step == K - 1)`)."),
    example=(
        "model = DDP(model)\n"
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    loss = criterion(model(x), y) / K\n"
        "    model.require_backward_grad_sync = (i % K == K - 1)  # after forward: late\n"
        "    loss.backward()"),
    error_when=(
        "the window's one sync ran on another backward than its last (the ranks consumed "
        "different gradients), or DDP synced on every micro-batch (K times the measured "
        "communication for the same update). Warning: FSDP2's reduce-scatter on every "
        "micro-batch while the update is right (a documented trade of communication for "
        "memory)."),
    measured="syncs per window (bytes), the backward that synced, rank drift",
    decided_in=f"{__name__}:missing_no_sync",
)


def missing_no_sync(seen: Observed) -> Finding:
    """`missing-no-sync`: DDP/FSDP synchronises gradients on the wrong micro-batches.
    Error / warning: `sync_on_every_micro_batch`, or a sync on the wrong backward (ranks drift).
    (`MISSING_NO_SYNC.error_when`)"""
    return Finding(seen.rung, KindId.MISSING_NO_SYNC, seen.severity,
                   **seen.fields(MISSING_NO_SYNC))


def sync_on_every_micro_batch(seen: Observed, *, sharded: bool, update_right: bool) -> Finding:
    """`missing-no-sync` for a loop whose gradient sync runs on more backwards than there are
    optimizer steps: the one decision of its severity.

    Under FSDP2 (`sharded`) a reduce-scatter on every micro-batch is a documented mode: each
    backward reduces its gradient into the sharded `.grad` and frees the unsharded one, so a
    rank never holds the unsharded gradient accumulated over the window; the price is K times
    the communication. When the update it produced matches the reference (`update_right`),
    that is a trade-off to know about, a warning. Under DDP the extra all-reduces save nothing
    (the accumulated gradient is held whole either way): the K-fold volume is the measured
    consequence, an error, as it is for FSDP2 when the update is also wrong."""
    severity = Severity.WARNING if sharded and update_right else Severity.ERROR
    return missing_no_sync(replace(seen, severity=severity))


@dataclass(frozen=True)
class RanksCompared:
    """What the ddp-sync rung measured of the ranks' consumed gradients: the first rank off the
    reference (rank 0 where only the ranks parted), its first bad step's numbers against the
    reference of the global batch, and how far the ranks' gradients and parameters ended
    apart."""

    rank: int
    step: int | None
    ratio: float | None             # |consumed| / |reference| at that step
    cosine: float | None
    relative_error: float | None
    max_difference: float           # largest gradient difference between the ranks (relative)
    first_apart: int | None         # the first step the ranks' gradients differ beyond tolerance
    parameter_difference: float | None
    world_size: int
    ratio_before_clip: float | None = None   # where a clip that bit hid the factor

    def evidence(self) -> Evidence:
        """The numbers every ddp-sync finding of a consumed gradient carries."""
        numbers: Evidence = {
            "rank": self.rank, "step": self.step,
            "ratio": None if self.ratio is None else round(self.ratio, 6),
            "cosine": None if self.cosine is None else round(self.cosine, 6),
            "relative_error": (None if self.relative_error is None
                               else round(self.relative_error, 6)),
            "max_gradient_difference_between_ranks": round(self.max_difference, 6),
            "first_step_ranks_differ": self.first_apart,
            "parameter_difference_between_ranks": self.parameter_difference,
            "world_size": self.world_size}
        if self.ratio_before_clip is not None:
            numbers["ratio_before_clip"] = round(self.ratio_before_clip, 6)
        return numbers

    @property
    def drift(self) -> float:
        """How far the ranks' parameters ended apart (relative; 0 where not measured)."""
        return self.parameter_difference or 0


@dataclass(frozen=True)
class TooManySyncs:
    """More syncing backwards than optimizer steps: what the ddp-sync rung counted of rank 0's
    gradient communication, and whether the update it produced was right."""

    rung: str
    who: str
    synced: int                 # backwards that synced
    backwards: int
    windows: int                # optimizer steps
    per_window: int             # backwards per window (K)
    total_bytes: int            # bytes the syncs communicated
    one_sync_bytes: int         # bytes the window's one sync needs
    world_size: int
    sharded: bool               # FSDP2 reduce-scatters into sharded gradients
    update_right: bool          # every rank's consumed gradient matched the reference
    worst: float                # the largest relative error of a consumed gradient
    last_missed: tuple[int, ...] = ()   # windows whose last backward did not sync
    no_sync_entered: bool = False       # the loop entered no_sync() (after the forward)
    location: Location | None = None

    @property
    def per_step(self) -> float:
        return self.synced / self.windows


def too_many_syncs(o: TooManySyncs) -> Finding:
    """`missing-no-sync` of the communication volume (severity: `sync_on_every_micro_batch`)."""
    words = words_of(o.who)
    per_step = o.per_step
    volume = (f"{words['who']} {words['verb']} gradients on {o.synced} of "
              f"{o.backwards} backward passes for {o.windows} optimizer steps "
              f"({per_step:.3g} per step): {o.total_bytes / o.windows:,.0f} bytes per window "
              f"against the {o.one_sync_bytes:,} a single sync needs.")
    evidence: Evidence = {
        "measured": round(per_step, 6), "expected": 1.0,
        "bytes_per_window": round(o.total_bytes / o.windows),
        "minimum_bytes_per_window": o.one_sync_bytes, "world_size": o.world_size}
    if o.sharded:
        evidence["reduce_scatters_per_window"] = round(per_step, 6)
    else:
        evidence["allreduces_per_window"] = round(per_step, 6)
    fix = ""
    if o.sharded and o.update_right:
        # FSDP2's sync-every-micro-batch mode: each backward reduce-scatters its gradient into
        # the sharded .grad and frees the unsharded one; with set_requires_gradient_sync(False)
        # the unsharded gradient (one reduce-scatter's input) is held over the window instead.
        evidence["unsharded_gradient_bytes_not_held"] = o.one_sync_bytes
        evidence["max_relative_error"] = round(o.worst, 9)
        message = (volume + " The update is right (every rank's consumed gradient matched the "
                   f"reference, max relative error {o.worst:.2g}): this is FSDP2's documented "
                   "sync-on-every-micro-batch mode, a trade. It costs "
                   f"{per_step:.3g}x the gradient communication of one {words['noun']} per "
                   f"window; it saves holding the unsharded gradient accumulated over the "
                   f"window, about {o.one_sync_bytes:,} bytes per rank (estimated: one "
                   f"{words['noun']}'s input), between micro-batches.")
        fix = ("Keep it if memory is what limits you. Otherwise switch sync off for the first "
               f"K-1 micro-batches of each window ({words['switch']}, on again before the "
               "last forward) for one reduce-scatter per optimizer step.")
    elif o.last_missed:
        message = (volume + f" The window's last backward did not sync (window(s) "
                   f"{', '.join(map(str, o.last_missed))}): its gradient {words['unsynced']}.")
    else:
        message = volume + (
            " no_sync() was entered, but after the forward: DDP decides in forward() whether "
            "the backward all-reduces, so the context must hold the forward too."
            if o.no_sync_entered else
            f" The first K-1={o.per_window - 1} micro-batches of each window need "
            f"{words['switch']}.")
    return sync_on_every_micro_batch(
        Observed(o.rung, Severity.ERROR, message, evidence=evidence, location=o.location,
                 fix=fix),
        sharded=o.sharded, update_right=o.update_right and not o.last_missed)


@dataclass(frozen=True)
class SyncOnWrongBackward:
    """One sync per window, but on another backward than the window's last."""

    rung: str
    who: str
    position: int                   # the first wrong sync's backward in its window (1-based)
    per_window: int
    positions: tuple[int, ...]      # every sync's backward in its window
    apart: bool                     # the ranks' consumed gradients differ beyond tolerance
    ranks: RanksCompared
    location: Location | None = None


def sync_on_wrong_backward(o: SyncOnWrongBackward) -> Finding:
    """`missing-no-sync` of a sync on the wrong backward: an error (the later micro-batches'
    gradients missed the update)."""
    words = words_of(o.who)
    r = o.ranks
    return missing_no_sync(Observed(o.rung, Severity.ERROR,
        f"{words['who']} {words['verb']} once per window, but on backward "
        f"{o.position} of {o.per_window}, not the last: the later micro-batches' "
        f"gradients {words['unsynced']}. "
        + (f"The ranks consumed gradients {r.max_difference:.3g} apart (relative, "
           f"first at step {r.first_apart}) and their parameters "
           f"ended {r.drift:.3g} apart." if o.apart else
           f"Rank {r.rank} consumed {r.ratio:.4g}x the reference gradient of the "
           f"global batch (cosine {r.cosine:.4f}) at step {r.step}."),
        evidence={"measured": o.position, "expected": o.per_window,
                  "synced_backward_in_window": list(o.positions), **r.evidence()},
        location=o.location))


@dataclass(frozen=True)
class ReplicasAllReducedLate:
    """HSDP all-reduced across the replicas on another backward than the window's last."""

    rung: str
    position: int               # the first all-reducing backward in its window (1-based)
    per_window: int
    missed: tuple[int, ...]     # the windows whose last backward did not all-reduce
    replica_all_reduces: int
    ranks: RanksCompared
    location: Location | None = None


def replicas_all_reduced_late(o: ReplicasAllReducedLate) -> Finding:
    """`missing-no-sync` of HSDP's all-reduce across replicas on the wrong backward: an
    error."""
    return missing_no_sync(Observed(o.rung, Severity.ERROR,
        f"HSDP all-reduced across the replicas on backward {o.position} of {o.per_window}, not "
        "the window's last (window(s) " + ", ".join(map(str, o.missed)) + "): the later "
        "micro-batches' reduce-scattered gradients were held aside and carried into the next "
        "window's all-reduce, out of this window's update.",
        evidence={"measured": o.position, "expected": o.per_window,
                  "replica_all_reduces": o.replica_all_reduces,
                  "windows_not_all_reduced": list(o.missed), **o.ranks.evidence()},
        location=o.location))
