"""Rung `ddp-sync`: one gradient all-reduce per optimizer step, not K (article §§1, 13).

ampdoctor starts `ddp.world_size` processes (gloo on CPU, nccl on CUDA), builds model and
optimizer on every rank from the same seed, wraps the model in DistributedDataParallel, gives
each rank its shard of every micro-batch and runs the user's loop in fp32. A DDP communication
hook counts the buckets each backward all-reduces: with `no_sync()` on the first K-1
micro-batches of a window only the K-th backward communicates.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..findings import Finding, Location, RungResult

RUNG = "ddp-sync"
#: Seconds the whole multi-process run may take before ampdoctor stops it (a rank waiting for
#: a collective the other never joins would otherwise hang forever).
DDP_TIMEOUT = 180.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _shard(mb: Any, rank: int, world_size: int) -> Any:
    def cut(t):
        n = t.shape[0] // world_size
        return t[rank * n:(rank + 1) * n]
    if isinstance(mb, dict):
        return {k: cut(v) for k, v in mb.items()}
    return tuple(cut(t) for t in mb)


def _worker(rank: int, spec_path: str, world_size: int, port: int, out_dir: str) -> None:
    """One rank: never raises (the parent reads what happened from its result file)."""
    os.dup2(2, 1)  # the user's prints must not reach ampdoctor's stdout (--json)
    result: dict[str, Any] = {"rank": rank, "hook_calls": [], "backwards": [], "steps": []}
    try:
        _run_rank(rank, spec_path, world_size, port, result)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(exc).__name__}: {exc}"
        site = result.get("_finder") and result["_finder"].from_traceback(exc.__traceback__)
        if site:
            result["error_site"] = [site.file, site.line]
    result.pop("_finder", None)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Tear down after the result is safe on disk, and leave without running interpreter
    # finalisers: gloo's threads can abort a process at exit ("terminate called without an
    # active exception"), which would turn a finished rank into a failed one.
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the work is done and recorded
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_rank(rank: int, spec_path: str, world_size: int, port: int,
              result: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from ..loading import (AUTOCAST_DTYPES, RunSettings, UserCode, build_model, build_optimizers,
                           cut_micro_batches, resolve_device, run_train_loop, to_device)
    from ..probe import patches, recorder, wrappers
    from ..probe.callsite import CallSiteFinder
    from ..spec import load_spec

    spec = load_spec(spec_path)
    finder = CallSiteFinder([spec.root, spec.spec_dir])
    result["_finder"] = finder
    device = resolve_device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world_size)
    try:
        with patches.installed(wrappers.install):
            code = UserCode(spec, finder)
            data = code.call("the data factory", code.data_factory)
            micro_batches = [to_device(_shard(mb, rank, world_size), device)
                             for mb in cut_micro_batches(data, spec)]
            model = build_model(code, device, spec.seed)
            loop_optimizer, flat = build_optimizers(code, model)
            ddp_model = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
            probe = recorder.Probe(finder, model, flat)
            probe.capture_grads = False

            def counting_hook(state, bucket):
                result["hook_calls"].append(probe.backward_count)
                return default_hooks.allreduce_hook(state, bucket)

            ddp_model.register_comm_hook(None, counting_hook)
            settings = RunSettings(
                precision="fp32", device=device, device_type=device.type,
                autocast_dtype=AUTOCAST_DTYPES["fp32"], accumulation_steps=spec.accumulation_steps,
                max_grad_norm=spec.max_grad_norm, rank=rank, world_size=world_size,
                micro_batch_size=(spec.micro_batch_size // world_size
                                  if spec.micro_batch_size else None),
                optimizer_steps=spec.optimizer_steps)
            previous = recorder.activate(probe)
            try:
                run_train_loop(code, ddp_model, loop_optimizer,
                               recorder.MicroBatchFeed(micro_batches, probe), settings)
            finally:
                recorder.activate(previous)
                result["backwards"] = [[e.site.file, e.site.line] if e.site else None
                                       for e in probe.events if e.kind == "backward"]
                result["steps"] = [s.backwards for s in probe.steps]
                result["step_sites"] = [[s.site.file, s.site.line] if s.site else None
                                        for s in probe.steps]
    except BaseException:
        dist.destroy_process_group()
        raise


def _run_ranks(spec_path: str, world_size: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ampdoctor-ddp-") as out_dir:
        context = mp.start_processes(_worker, args=(spec_path, world_size, _free_port(), out_dir),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + DDP_TIMEOUT
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world_size}-process DDP run did not finish within "
                                       f"{DDP_TIMEOUT:.0f} s (a rank waiting for a collective "
                                       "the others never join?)")
        except mp.ProcessExitedException:
            # A rank that died while tearing down, after its result was written, finished its
            # work; one that died before writing it did not.
            if not all(Path(out_dir, f"rank{r}.json").exists() for r in range(world_size)):
                raise
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
        results = []
        for rank in range(world_size):
            path = Path(out_dir, f"rank{rank}.json")
            results.append(json.loads(path.read_text()) if path.exists()
                           else {"rank": rank, "error": "the rank exited without a result"})
        return results


def run(session) -> RungResult:
    spec = session.spec
    if spec.ddp is None:
        return RungResult(RUNG, "skip", "no `ddp` in the spec")
    world_size = spec.ddp.world_size
    if world_size < 2:
        return RungResult(RUNG, "skip", "ddp.world_size is 1: there is nothing to synchronise")
    for index, mb in enumerate(session.micro_batches[:1]):
        tensors = list(mb.values()) if isinstance(mb, dict) else list(mb)
        if any(t.shape[0] % world_size for t in tensors):
            return RungResult(RUNG, "skip", f"micro-batch {index} ({tensors[0].shape[0]} samples) "
                              f"does not split evenly over {world_size} ranks")
    try:
        results = _run_ranks(str(spec.spec_path), world_size)
    except (TimeoutError, Exception) as exc:  # a launcher failure, not the user's loop
        return RungResult(RUNG, "fail", f"the DDP run could not complete: {exc}", [Finding(
            RUNG, "loop-error", "error", f"The {world_size}-process DDP run failed: {exc}",
            evidence={"error": str(exc), "world_size": world_size})])
    errors = [r for r in results if r.get("error")]
    if errors:
        err = errors[0]
        site = err.get("error_site")
        return RungResult(RUNG, "fail", "the loop raised under DDP", [Finding(
            RUNG, "loop-error", "error",
            f"The loop raised on rank {err['rank']} of the DDP run: {err['error']}",
            evidence={"error": err["error"], "world_size": world_size},
            location=Location(site[0], site[1]) if site else None)])
    rank0 = results[0]
    K = session.K
    steps = rank0["steps"]
    reducing = sorted(set(rank0["hook_calls"]))      # backward ordinals that communicated
    buckets = len(rank0["hook_calls"])
    windows = max(1, len(steps))
    per_step = len(reducing) / windows
    details = {"world_size": world_size, "allreducing_backwards": reducing,
               "buckets_allreduced": buckets, "optimizer_steps": len(steps),
               "backwards": len(rank0["backwards"])}
    if per_step > 1.0:
        boundaries = set(steps)
        extra = [b for b in reducing if b not in boundaries]
        site = rank0["backwards"][extra[0] - 1] if extra else None
        finding = Finding(
            RUNG, "missing-no-sync", "error",
            f"DDP all-reduced gradients on {len(reducing)} of {len(rank0['backwards'])} "
            f"backward passes for {len(steps)} optimizer steps ({per_step:.3g} per step, "
            f"{buckets} bucket all-reduces in all): the first K-1={K - 1} micro-batches of each "
            "window are not inside model.no_sync().",
            evidence={"measured": round(per_step, 6), "expected": 1.0,
                      "allreducing_backwards": len(reducing), "optimizer_steps": len(steps),
                      "buckets": buckets, "world_size": world_size},
            location=Location(site[0], site[1]) if site else None)
        return RungResult(RUNG, "fail", f"{per_step:.3g} gradient all-reduces per optimizer step, "
                          "expected 1", [finding], details=details)
    return RungResult(RUNG, "pass", f"one gradient all-reduce per optimizer step over "
                      f"{world_size} ranks ({len(steps)} steps, {buckets} bucket all-reduces)",
                      details=details)

