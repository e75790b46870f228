"""The gradient synchronisation kind of DDP / FSDP: `missing-no-sync`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import replace

from ..enums import KindId, Severity
from ..findings import Finding
from .base import Kind, Observed

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
