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
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from ..core.enums import RungId
from ..core.safetext import exc_text

if TYPE_CHECKING:
    from ..judge import Judgement, StepJudgement
    from ..probe.callsite import CallSiteFinder, Site
    from ..probe.recorder import Probe
    from ..session import Session, Trace

RUNG = RungId.DDP_SYNC
#: Calls per rank kept for the comparison of the ranks' call sequences.
MAX_CALLS = 20_000
#: Under FSDP2 each rank judges its own piece of every gradient (`shards`); the tests set
#: AMPDOCTOR_GATHER_SHARDS=1 to judge the gathered whole instead and compare the numbers.
SHARD_WISE = os.environ.get("AMPDOCTOR_GATHER_SHARDS") != "1"


def shard(mb: Any, rank: int, world_size: int) -> Any:
    """This rank's contiguous slice of a micro-batch (its own storage)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // world_size
        return t[rank * n:(rank + 1) * n].clone()
    if isinstance(mb, dict):
        return {k: cut(v) for k, v in mb.items()}
    return tuple(cut(t) for t in mb)


def _site(site: Site | None) -> list[Any] | None:
    return [site.file, site.line, site.function] if site is not None else None


class SyncObserver:
    """Wraps the model in a DistributedDataParallel that records how the loop switches sync."""

    #: shards the model in place before its optimizer is built (FSDP only)
    shard: Callable[[torch.nn.Module], None] | None = None

    def __init__(self, finder: CallSiteFinder, device: torch.device) -> None:
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

    def wrap(self, model: torch.nn.Module, probe: Probe) -> torch.nn.Module:
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
            def no_sync(self) -> Iterator[None]:  # DDP's own, minus recording its flag sets
                site = observer.finder.from_frame(sys._getframe(1))
                observer.no_syncs.append([_site(site), probe.backward_count])
                old = self.require_backward_grad_sync
                torch.nn.Module.__setattr__(self, "require_backward_grad_sync",
                                            False)  # type: ignore[arg-type]
                try:
                    yield
                finally:
                    torch.nn.Module.__setattr__(self, "require_backward_grad_sync",
                                                old)  # type: ignore[arg-type]

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp_model = RecordingDDP(model, device_ids=device_ids)

        def counting_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            self.buckets.append([probe.backward_count, buffer.numel() * buffer.element_size()])
            return default_hooks.allreduce_hook(state, bucket)
        counting_hook.__annotations__ = {}   # DDP compares them with its own types (not strings)
        ddp_model.register_comm_hook(None, counting_hook)
        self.recording = True
        return ddp_model


class EngineObserver(SyncObserver):
    """`ddp: {wrapper: deepspeed}`: the loop's own DeepSpeed engine does the communication
    (it reduces at its accumulation boundary, or per micro-batch under ZeRO-2/3, as its config
    says). The loop is handed the model itself, as in a single-process run; the rung judges
    what every rank's engine consumed (read by probe/deepspeed.py, shards summed)."""

    def wrap(self, model: torch.nn.Module, probe: Probe) -> torch.nn.Module:
        self.recording = True
        return model


def hsdp_shape(world_size: int) -> tuple[int, int]:
    """HSDP's device mesh, (replicas, shards per replica): replicate across nodes, shard inside
    a node. Under torchrun a node holds LOCAL_WORLD_SIZE ranks; spawned ranks share one machine,
    taken as two nodes where the world size allows."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not 0 < local <= world_size or world_size % local:
        local = world_size // 2 if world_size % 2 == 0 else world_size
    return world_size // local, local


class ShardObserver(SyncObserver):
    """FSDP2 (`fully_shard`): accumulation is `set_requires_gradient_sync(False)` on the first
    K-1 micro-batches; each synchronising backward reduce-scatters the gradients (under HSDP,
    then all-reduces them across the replicas)."""

    #: the device mesh of HSDP's 2-D sharding (replicate, shard); None: FSDP over every rank
    hsdp: tuple[int, int] | None = None
    mesh: Any = None
    #: judge each rank's own piece of every gradient (`shards`), not the gathered whole
    shard_wise = SHARD_WISE

    def __init__(self, finder: CallSiteFinder, device: torch.device) -> None:
        super().__init__(finder, device)
        #: HSDP: the backward ordinal of each all-reduce across the replicas
        self.replica_reduces: list[int] = []
        #: HSDP: [value, site, backwards before it] for each set_requires_all_reduce
        self.all_reduce_toggles: list[list[Any]] = []

    def shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.hsdp is None:
            fully_shard(model)
            return
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, self.hsdp,
                                     mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=self.mesh)

    def replica_group(self) -> Any:
        """The process group of the ranks holding the same pieces (HSDP), or None."""
        return self.mesh.get_group("replicate") if self.mesh is not None else None

    def wrap(self, model: torch.nn.Module, probe: Probe) -> torch.nn.Module:
        import torch.distributed as dist

        probe.shard_wise = self.shard_wise
        observer = self
        # fully_shard swapped the module's class for an FSDPModule subclass at run time
        sharded: Any = model
        original = sharded.set_requires_gradient_sync

        def set_requires_gradient_sync(requires_gradient_sync: bool, *args: Any,
                                       **kwargs: Any) -> Any:
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

        def counting(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            size = tensor.numel() * tensor.element_size() if tensor is not None else 0
            observer.buckets.append([probe.backward_count, size])
            return collective(*args, **kwargs)

        setattr(dist, name, counting)
        self.restore = lambda: setattr(dist, name, collective)
        if self.mesh is not None:
            self._watch_replicas(sharded, probe)
        self.recording = True
        return model

    def _watch_replicas(self, sharded: Any, probe: Probe) -> None:
        """HSDP: record each all-reduce across the replicas (after a reduce-scatter) and each
        `set_requires_all_reduce` the loop calls, with its line."""
        import torch.distributed as dist

        observer, group = self, self.replica_group()
        original = sharded.set_requires_all_reduce

        def set_requires_all_reduce(requires_all_reduce: bool, *args: Any, **kwargs: Any) -> Any:
            if observer.recording:
                site = observer.finder.from_frame(sys._getframe(1))
                observer.all_reduce_toggles.append([bool(requires_all_reduce), _site(site),
                                                    probe.backward_count])
            return original(requires_all_reduce, *args, **kwargs)

        sharded.set_requires_all_reduce = set_requires_all_reduce
        all_reduce, restore = dist.all_reduce, self.restore

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group") is group and observer.recording:
                observer.replica_reduces.append(probe.backward_count)
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting

        def restore_both() -> None:
            restore()
            dist.all_reduce = all_reduce

        self.restore = restore_both


def _relative_differences(vectors: list[torch.Tensor]) -> tuple[list[float], int]:
    """|| v_r - v_0 || / || v_0 || for every rank r (gathered over the process group); and the
    bytes the largest gather held."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    out: list[float] = []
    held = 0
    for v in vectors:   # sizes differ between the steps of different optimizers
        gathered = [torch.empty_like(v) for _ in range(world_size)]
        dist.all_gather(gathered, v.contiguous())
        # this rank's vector and every rank's, gathered
        held = max(held, (world_size + 1) * v.numel() * v.element_size())
        base = float(gathered[0].double().norm()) or 1.0
        out.append(max(float((g.double() - gathered[0].double()).norm()) / base
                       for g in gathered))
    return out, held


def _pieces_apart(vectors: list[torch.Tensor], replicas: Any) -> tuple[list[float], int]:
    """Sharded (FSDP2): each rank holds its own piece of one gradient, so only replicas of a
    piece (HSDP) can disagree. For each vector of this rank's pieces: the replicas' distance
    from their mean over the mean's norm, summed over every rank's pieces (scalars only); 0
    under FSDP, where every piece has one holder. And the bytes the comparison held."""
    import torch.distributed as dist

    from ..maths.compare import sum_of_squares
    from ..maths.shards import all_sum

    out: list[float] = []
    held = 0
    count = dist.get_world_size(replicas) if replicas is not None else 1
    for v in vectors:
        mean, apart = v, 0.0
        if replicas is not None:
            mean = v.clone()
            dist.all_reduce(mean, group=replicas)
            mean /= count
            apart = sum_of_squares(v - mean)
        # this rank's pieces, their mean over the replicas and its difference (HSDP)
        held = max(held, (1 if replicas is None else 3) * v.numel() * v.element_size())
        apart, norm = all_sum([apart, sum_of_squares(mean)], 1)
        out.append(math.sqrt(apart / norm) if norm > 0 else (0.0 if apart == 0 else math.inf))
    return out, held


def _whole(grads: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """A step's gradients whole: each rank's pieces put together (a collective, the same
    step on every rank); a gradient that is not a piece as it is."""
    from ..maths.shards import place_of, whole

    out: dict[str, torch.Tensor | None] = {}
    for name, g in grads.items():
        place = place_of(g)
        out[name] = whole(g, place) if g is not None and place is not None else g
    return out


def _consumed_bytes(steps: Iterable[StepJudgement]) -> int:
    """Bytes of the consumed-gradient copies the rank keeps for its judge."""
    return sum(g.numel() * g.element_size() for s in steps for g in s.step.grads.values()
               if g is not None)


def _agreement(session: Session, judgement: Judgement, model: torch.nn.Module,
               observer: SyncObserver) -> dict[str, Any]:
    """How far each step's consumed gradient, and the final parameters, are from rank 0's
    (sharded: how far the replicas of each piece are apart); and the bytes the comparison held
    on this rank."""
    import torch.distributed as dist

    from ..probe.recorder import full_tensor
    from ..session import flat

    counts: list[Any] = [None] * dist.get_world_size()   # each rank's step count, gathered
    dist.all_gather_object(counts, len(judgement.steps))
    steps = judgement.steps[:min(counts)]
    sharded = isinstance(observer, ShardObserver) and observer.shard_wise
    if sharded:
        replicas = cast(ShardObserver, observer).replica_group()
        grads = [torch.cat([g.reshape(-1) for g in s.step.grads.values() if g is not None]
                           or [torch.zeros(0)]) for s in steps]
        local: list[Any] = [p.detach() for p in model.parameters()]
        params = torch.cat([p.to_local().reshape(-1).float().cpu() for p in local])
        per_step, held = _pieces_apart(grads, replicas)
        final = _pieces_apart([params], replicas)[0][0]
    else:
        grads = [flat(session, s.step.grads, s.names).to(session.device) for s in steps]
        params = torch.cat([full_tensor(p.detach()).reshape(-1).float()
                            for p in model.parameters()])
        per_step, held = _relative_differences(grads)
        final = _relative_differences([params])[0][0]
    consumed = _consumed_bytes(judgement.steps)
    return {"steps_per_rank": counts, "gradient_difference": per_step,
            "parameter_difference": final, "shard_wise": sharded,
            "comparison_bytes": {"consumed_gradients": consumed, "rank_agreement": held,
                                 "total": consumed + held}}


def _unclipped_ratio(session: Session, trace: Trace, judged: StepJudgement) -> float | None:
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
    from ..judge import judge
    from ..ladder.analysis import rerun_for
    from ..loading import UserCode, cut_micro_batches, merge_micro_batches, resolve_device
    from ..probe import patches, wrappers
    from ..probe.callsite import CallSiteFinder
    from ..probe.events import Backward, EngineBuilt, Forward, MicroBatchFetched
    from ..rules import classify_step
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
        wrapper = spec.ddp.wrapper if spec.ddp else "ddp"
        observer: SyncObserver = SyncObserver(finder, device)
        if wrapper == "deepspeed":
            observer = EngineObserver(finder, device)
        elif wrapper in ("fsdp", "hsdp"):
            observer = ShardObserver(finder, device)
            observer.hsdp = hsdp_shape(world_size) if wrapper == "hsdp" else None
            # without a `loss`, micro-batches that cannot form one batch make the judge guess
            # their weighting on the whole gradient: judged gathered, as a plain run is
            observer.shard_wise = SHARD_WISE and (
                code.loss is not None or merge_micro_batches(session.micro_batches) is not None)
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
        if isinstance(observer, ShardObserver):
            # FSDP over every rank, or HSDP's (replicas, shards per replica)
            result["mesh"] = list(observer.hsdp or (world_size,))
            if observer.mesh is not None:
                result.update(replica_reduces=observer.replica_reduces,
                              all_reduce_toggles=observer.all_reduce_toggles)
        result.update(buckets=observer.buckets, toggles=observer.toggles,
                      no_syncs=observer.no_syncs,
                      backwards=[_site(e.site) for e in trace.events_of(Backward)],
                      # the calls the loop made, in order: where ranks part ways, a line differs
                      calls=[[e.kind] + (_site(e.site) or [None, None, None])
                             for e in trace.events
                             if not isinstance(e, (Forward, MicroBatchFetched))][:MAX_CALLS],
                      steps=[s.backwards for s in trace.steps],
                      # the loop built a DeepSpeed engine (which communicates itself)
                      engine_built=bool(trace.events_of(EngineBuilt)),
                      step_sites=[_site(s.site) for s in trace.steps])
        if trace.error is not None:
            result["error_time"] = trace.error_time
            result["error"] = exc_text(trace.error)
            result["error_site"] = _site(trace.error_site)
            return
        judgement = judge(session, trace, "fp32")
        if judgement.weighting is not None:
            session.adopt_weighting(judgement.weighting)
        mismatch = []
        if judgement.first_bad is not None:
            # every rank found the same first bad step (its numbers are sums over all ranks'
            # pieces): its shape is explained on the whole gradient, gathered for that step
            step = judgement.first_bad.step
            pieces, step.grads = step.grads, _whole(step.grads)
            mismatch = [classify_step(session, trace, RUNG, judgement, judgement.first_bad,
                                      rerun_for(session))]
            if bad_unclipped := _unclipped_ratio(session, trace, judgement.first_bad):
                result["first_bad_unclipped_ratio"] = bad_unclipped
            step.grads = pieces      # the whole copy was for the explanation only
        result["judged"] = [
            {"window": s.window, "ratio": s.metrics.ratio, "preclip_ratio": s.preclip_ratio,
             "cosine": s.metrics.cosine,
             "relative_error": s.metrics.rel_err, "bad": s.bad,
             "consumed": list(s.step.consumed),
             "site": _site(s.step.site)} for s in judgement.steps]
        result["findings"] = [f.to_dict() for f in mismatch]
        result["tolerance"] = judgement.tolerance.rtol
        model = trace.model
        assert model is not None     # the probe of a run of the loop holds the run's model
        result.update(_agreement(session, judgement, model, observer))
