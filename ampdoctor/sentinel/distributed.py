"""The sentinel under DistributedDataParallel (`ampdoctor.watch` on a DDP model, the Lightning
callback under a DDP strategy): each rank checks its own consumed gradient, and the ranks'
findings end in one record.

After the window's synchronising backward, the gradient every rank's optimizer consumes is the
mean over the ranks of each rank's window (DDP averages the all-reduced sum). The reference is
therefore the mean over the ranks of each rank's fp32 replay of its own micro-batches: each rank
replays its window as a single process would, then the replays are all-reduced and divided by the
world size, so every rank compares the same consumed gradient with the same reference (the
global-batch reference of the ladder's `ddp-sync` rung, built from the shards the ranks hold).
A rank that could not replay its window says so in the same collective, and no rank checks it.

At the end, the findings of every rank are gathered (each kind once, at its most severe, with the
ranks that saw it), every rank holds the same record, and rank 0 alone writes it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ..core.findings import Finding, Severity
from .checks import Window
from .replay import ReplayCheck, Replayed

if TYPE_CHECKING:
    from ..record.model import RecordModel


def replica_group(model: torch.nn.Module) -> Any:
    """The process group of a DistributedDataParallel model, or None for any other model."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(model, DistributedDataParallel):
        return None
    import torch.distributed as dist
    return getattr(model, "process_group", None) or dist.group.WORLD


def unwrap(model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any, Any]:
    """(module, optimizer, DDP process group or None): what the sentinel hooks and replays
    when the loop holds wrappers: DistributedDataParallel's `module`, Fabric's `_FabricModule`
    (its original module; its forward module may be DDP) and `_FabricOptimizer` (the
    optimizer it wraps)."""
    forward = getattr(model, "_forward_module", None)
    original = getattr(model, "_original_module", None)
    if isinstance(forward, torch.nn.Module) and isinstance(original, torch.nn.Module):
        model = original
    else:
        forward = model
    group = replica_group(forward)
    if group is not None and model is forward:
        model = getattr(forward, "module")  # noqa: B009 - DDP's, typed as a Tensor | Module
    inner = getattr(optimizer, "_optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        optimizer = inner
    return model, optimizer, group


def writes_record(group: Any) -> bool:
    """Whether this process writes the record: always outside DDP, rank 0 under it."""
    if group is None:
        return True
    import torch.distributed as dist
    return dist.get_rank(group) == 0


class DistributedReplay(ReplayCheck):
    """The expensive check with the reference averaged over the ranks (module docstring)."""

    group: Any = None
    #: what a cheap check of another rank found in this window, when this rank's found nothing
    _peer_explained: str | None = None

    def _explained(self, w: Window) -> str | None:
        """A finding of another rank explains this rank's mismatch too (a zero_grad inside the
        window on one rank changes the averaged gradient every rank consumes)."""
        return super()._explained(w) or self._peer_explained

    def _reference(self, w: Window) -> Replayed | None:
        reference = super()._reference(w)
        if self.group is None:
            return reference
        import torch.distributed as dist
        world = dist.get_world_size(self.group)
        self._peer_explained = None
        explained: list[Any] = [None] * world
        dist.all_gather_object(explained, self._explained(w), group=self.group)
        self._peer_explained = next((e for e in explained if e is not None), None)
        device = self.params[0].device if self.params else torch.device("cpu")
        # every rank joins both collectives: whether all replayed, then the replays' sum
        replayed = torch.tensor([0.0 if reference is None else 1.0], device=device)
        dist.all_reduce(replayed, group=self.group)
        if reference is None or int(replayed.item()) != world:
            if reference is not None:
                self.notes.append(f"optimizer step {self.updates}: another rank could not "
                                  "replay its window; the step is not checked")
            return None
        # (a weighted loss: each rank's own weighting, as each rank's consumed gradient has it;
        # the equal-weight alternative is averaged the same way, or dropped where one rank's
        # window had none, so every rank joins the same collectives)
        has_equal = torch.tensor([0.0 if reference.equal is None else 1.0], device=device)
        dist.all_reduce(has_equal, group=self.group)
        averaged = reference.reference + (reference.equal or []) \
            if int(has_equal.item()) == world else reference.reference
        for tensor in averaged:
            dist.all_reduce(tensor, group=self.group)
            tensor.div_(world)
        if int(has_equal.item()) != world:
            reference.equal = reference.counts = reference.own = None
        return reference


def ranks_record(watch: Any, gathered: bool) -> RecordModel:
    """The record of a watched DDP run: every rank's findings (each kind once, at its most
    severe, its evidence naming the ranks that saw it), the same on every rank. Without
    `gathered` (the run stopped with an exception: a peer may never reach the collective) the
    record is this rank's alone and says so."""
    import torch.distributed as dist
    group = watch.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if gathered:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, (rank, list(watch.findings)), group=group)
        watch.findings = merge_findings(parts, world)
    else:
        watch.notes.append(f"the run stopped with an exception on rank {rank}: the ranks' "
                           f"findings were not gathered; this record holds rank {rank}'s alone")
    record: RecordModel = watch._make_record()
    record.rungs[0].summary += f", on each of {world} DDP ranks"
    assert record.watch is not None
    record.watch.update(world_size=world, rank=rank, gathered=gathered)
    return record


def merge_findings(parts: list[tuple[int, list[Finding]]], world: int) -> list[Finding]:
    """The ranks' findings as one list: each kind once (an error over a warning, the lowest
    rank's otherwise), with `rank` (the ranks that found it) and `world_size` in its evidence.
    Ranks that saw nothing add nothing."""
    kept: dict[str, Finding] = {}
    seen: dict[str, list[int]] = {}
    for rank, findings in sorted(parts, key=lambda part: part[0]):
        for finding in findings:
            seen.setdefault(finding.kind, []).append(rank)
            first = kept.get(finding.kind)
            if first is None or (first.severity != Severity.ERROR
                                 and finding.severity == Severity.ERROR):
                kept[finding.kind] = finding
    out = []
    for kind, finding in kept.items():
        evidence = dict(finding.evidence)
        evidence["rank"] = seen[kind]
        evidence["world_size"] = world
        out.append(dataclasses.replace(finding, evidence=evidence))  # type: ignore[arg-type]
    return out
