"""One rank of the `ddp-sync` rung: the user's loop on this rank's shards, judged here.

Every rank loads the spec, builds the whole session (model, optimizer, every micro-batch: the
reference is the fp32 gradient over the *global* batch of a window, all ranks' shards together),
hands the loop the model wrapped in DistributedDataParallel and its own shard of every micro-batch,
and records:

- which backward of each window all-reduced, and how many bytes (a DDP communication hook);
- every `no_sync()` entered and every `require_backward_grad_sync` the loop set, with its line
  (nanoGPT's idiom is the same switch as `no_sync()`: DDP reads the flag in forward());
- the gradient its optimizer consumed at every step, judged against the reference by the same
  judge as the single-process rungs (dropout is off on the ranks and in the reference: a shard
  cannot draw the mask its micro-batch drew whole);
- after the loop, how far its consumed gradients and final parameters are from rank 0's
  (collectives over the loop's own process group).

The result is a JSON-able dict; `ampdoctor.ddp.launch` carries it to the rung.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..enums import RungId
from ..safetext import exc_text

RUNG = RungId.DDP_SYNC
#: Calls per rank kept for the comparison of the ranks' call sequences.
MAX_CALLS = 20_000


def shard(mb: Any, rank: int, world_size: int) -> Any:
    """This rank's contiguous slice of a micro-batch (its own storage)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // world_size
        return t[rank * n:(rank + 1) * n].clone()
    if isinstance(mb, dict):
        return {k: cut(v) for k, v in mb.items()}
    return tuple(cut(t) for t in mb)


def _site(site) -> list[Any] | None:
    return [site.file, site.line, site.function] if site is not None else None


class SyncObserver:
    """Wraps the model in a DistributedDataParallel that records how the loop switches sync."""

    #: shards the model in place before its optimizer is built (FSDP only)
    shard: Callable[[torch.nn.Module], None] | None = None

    def __init__(self, finder, device: torch.device):
        self.finder = finder
        self.device = device
        #: [backward ordinal (1-based) during which a bucket was all-reduced, bytes]
        self.buckets: list[list[int]] = []
        #: [value, site, backwards before it] for each require_backward_grad_sync the loop set
        self.toggles: list[list[Any]] = []
        #: [site, backwards before it] for each no_sync() the loop entered
        self.no_syncs: list[list[Any]] = []
        self.recording = False
        self.restore: Callable[[], None] = lambda: None

    def wrap(self, model: torch.nn.Module, probe) -> torch.nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        observer = self

        class RecordingDDP(DistributedDataParallel):
            def __setattr__(self, name: str, value: Any) -> None:
                if name == "require_backward_grad_sync" and observer.recording:
                    site = observer.finder.from_frame(sys._getframe(1))
                    observer.toggles.append([bool(value), _site(site), probe.backward_count])
                super().__setattr__(name, value)

            @contextlib.contextmanager
            def no_sync(self):  # DDP's own, minus the recording of its internal flag sets
                site = observer.finder.from_frame(sys._getframe(1))
                observer.no_syncs.append([_site(site), probe.backward_count])
                old = self.require_backward_grad_sync
                torch.nn.Module.__setattr__(self, "require_backward_grad_sync", False)
                try:
                    yield
                finally:
                    torch.nn.Module.__setattr__(self, "require_backward_grad_sync", old)

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp_model = RecordingDDP(model, device_ids=device_ids)

        def counting_hook(state, bucket):
            buffer = bucket.buffer()
            self.buckets.append([probe.backward_count, buffer.numel() * buffer.element_size()])
            return default_hooks.allreduce_hook(state, bucket)

        ddp_model.register_comm_hook(None, counting_hook)
        self.recording = True
        return ddp_model


class ShardObserver(SyncObserver):
    """FSDP2 (`fully_shard`): accumulation is `set_requires_gradient_sync(False)` on the first
    K-1 micro-batches; each synchronising backward reduce-scatters the gradients."""

    def shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)

    def wrap(self, model: torch.nn.Module, probe) -> torch.nn.Module:
        import torch.distributed as dist

        observer = self
        # fully_shard swapped the module's class for an FSDPModule subclass at run time
        sharded: Any = model
        original = sharded.set_requires_gradient_sync

        def set_requires_gradient_sync(requires_gradient_sync: bool, *args, **kwargs):
            if observer.recording:
                site = observer.finder.from_frame(sys._getframe(1))
                observer.toggles.append([bool(requires_gradient_sync), _site(site),
                                         probe.backward_count])
            return original(requires_gradient_sync, *args, **kwargs)

        sharded.set_requires_gradient_sync = set_requires_gradient_sync
        # FSDP2 calls torch.distributed's reduce-scatter by attribute at each sync
        name = next(n for n in ("reduce_scatter_single", "reduce_scatter_tensor")
                    if hasattr(dist, n))
        collective = getattr(dist, name)

        def counting(*args, **kwargs):
            tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            size = tensor.numel() * tensor.element_size() if tensor is not None else 0
            observer.buckets.append([probe.backward_count, size])
            return collective(*args, **kwargs)

        setattr(dist, name, counting)
        self.restore = lambda: setattr(dist, name, collective)
        self.recording = True
        return model


def _relative_differences(vectors: list[torch.Tensor]) -> list[float]:
    """|| v_r - v_0 || / || v_0 || for every rank r (gathered over the process group)."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    out: list[float] = []
    for v in vectors:   # sizes differ between the steps of different optimizers
        gathered = [torch.empty_like(v) for _ in range(world_size)]
        dist.all_gather(gathered, v.contiguous())
        base = float(gathered[0].double().norm()) or 1.0
        out.append(max(float((g.double() - gathered[0].double()).norm()) / base
                       for g in gathered))
    return out


def _agreement(session, judgement, model: torch.nn.Module) -> dict[str, Any]:
    """How far each step's consumed gradient, and the final parameters, are from rank 0's."""
    import torch.distributed as dist

    from ..probe.recorder import full_tensor
    from ..session import flat

    counts: list[Any] = [None] * dist.get_world_size()   # each rank's step count, gathered
    dist.all_gather_object(counts, len(judgement.steps))
    steps = judgement.steps[:min(counts)]
    grads = [flat(session, s.step.grads, s.names).to(session.device) for s in steps]
    params = torch.cat([full_tensor(p.detach()).reshape(-1).float() for p in model.parameters()])
    per_step = _relative_differences(grads)
    final = _relative_differences([params])[0]
    return {"steps_per_rank": counts, "gradient_difference": per_step,
            "parameter_difference": final}


def _unclipped_ratio(session, trace, judged) -> float | None:
    """The consumed gradient's norm over the reference's, both before any clip: the factor a
    clip hides (a loss divided by world_size, clipped to max_grad_norm like the reference)."""
    from ..rules.accumulation import unclipped
    from ..session import flat

    step = judged.step
    snapshot = trace.snapshots.get(step.group)
    if snapshot is None:
        return None
    names = [n for n in step.grads if n in session.param_shapes]
    user, _ = unclipped(flat(session, step.grads, names), list(judged.events))
    ref = session.reference(judged.window, snapshot.state, snapshot.training, per_mb=False)
    ref_norm = float(flat(session, ref.full, names).norm())
    return float(user.norm()) / ref_norm if ref_norm else None


def run_rank(rank: int, world_size: int, spec_path: str, result: dict[str, Any]) -> None:
    """The rank's whole job, inside an initialised default process group. Fills `result`."""
    from ..ladder.analysis import compare_trace
    from ..loading import UserCode, cut_micro_batches, resolve_device
    from ..probe import patches, wrappers
    from ..probe.callsite import CallSiteFinder
    from ..probe.events import Backward, Forward, MicroBatchFetched
    from ..session import Distributed, Session
    from ..spec import from_wire

    spec = from_wire(spec_path)
    finder = CallSiteFinder([spec.root, spec.spec_dir])
    result["_finder"] = finder
    device = resolve_device(spec.device, spec)
    if device.type == "cuda":
        device = torch.device("cuda", int(torch.cuda.current_device()))
    with patches.installed(wrappers.install):
        code = UserCode(spec, finder)
        data = code.call("the data factory", code.data_factory)
        session = Session(spec, code, device, finder, cut_micro_batches(data, spec))
        session.align_seed = None          # dropout off: see the module docstring
        session.dropout_off = True
        observer = (ShardObserver if spec.ddp and spec.ddp.wrapper == "fsdp"
                    else SyncObserver)(finder, device)
        distributed = Distributed(
            rank=rank, world_size=world_size,
            shards=[shard(mb, rank, world_size) for mb in session.micro_batches],
            micro_batch_size=(spec.micro_batch_size // world_size
                              if spec.micro_batch_size else None),
            wrap=observer.wrap, shard=observer.shard)
        try:
            trace = session.run_loop("fp32", rng_seed=spec.seed + 1, distributed=distributed)
        finally:
            observer.recording = False
            observer.restore()
        result.update(buckets=observer.buckets, toggles=observer.toggles,
                      no_syncs=observer.no_syncs,
                      backwards=[_site(e.site) for e in trace.events_of(Backward)],
                      # the calls the loop made, in order: where ranks part ways, a line differs
                      calls=[[e.kind] + (_site(e.site) or [None, None, None])
                             for e in trace.events
                             if not isinstance(e, (Forward, MicroBatchFetched))][:MAX_CALLS],
                      steps=[s.backwards for s in trace.steps],
                      step_sites=[_site(s.site) for s in trace.steps])
        if trace.error is not None:
            result["error_time"] = trace.error_time
            result["error"] = exc_text(trace.error)
            result["error_site"] = _site(trace.error_site)
            return
        mismatch, judgement = compare_trace(session, trace, RUNG, "fp32")
        result["judged"] = [
            {"window": s.window, "ratio": s.metrics.ratio, "preclip_ratio": s.preclip_ratio,
             "cosine": s.metrics.cosine,
             "relative_error": s.metrics.rel_err, "bad": s.bad,
             "consumed": list(s.step.consumed),
             "site": _site(s.step.site)} for s in judgement.steps]
        bad = judgement.first_bad
        if bad is not None:
            result["first_bad_unclipped_ratio"] = _unclipped_ratio(session, trace, bad)
        result["findings"] = [f.to_dict() for f in mismatch]
        result["tolerance"] = judgement.tolerance.rtol
        model = trace.model
        assert model is not None     # the probe of a run of the loop holds the run's model
        result.update(_agreement(session, judgement, model))
