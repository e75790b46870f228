"""The ddp-sync rung's wall time against a plain two-process DDP run of the same loop.

    python bench/bench_ddp.py [--config sample_configs/healthy_sgd_ddp.yaml] [--repeats 3]

(a) the `ddp-sync` rung's own time as the record reports it (`ampdoctor diagnose`, ranks
    spawned by ampdoctor: start, load the user's code, run the loop under the probe, build the
    reference on every rank, judge, compare the ranks);
(b) a plain run of the same loop: world_size processes spawned the same way (spawn start
    method, gloo on CPU), each building the model and optimizer from the spec's factories,
    wrapping it in DistributedDataParallel and running the loop on its shards -- no probe, no
    reference, no judge.

Both are timed with time.perf_counter; medians of --repeats runs, alternated.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rung_seconds(config: Path) -> float:
    exe = shutil.which("ampdoctor")
    cmd = ([exe] if exe else [sys.executable, "-m", "ampdoctor"]) + [
        "diagnose", str(config), "--json"]
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(cmd + ["--out", out], capture_output=True, text=True)
    record = json.loads(proc.stdout)
    rung = next(r for r in record["rungs"] if r["id"] == "ddp-sync")
    if rung["status"] not in ("pass", "warn"):
        raise SystemExit(f"the ddp-sync rung did not pass: {rung['summary']}")
    return float(rung["seconds"])


def _plain_rank(rank: int, world_size: int, spec_path: str, port: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ampdoctor.ddp.rank import shard
    from ampdoctor.loading import (
        AUTOCAST_DTYPES,
        RunSettings,
        UserCode,
        build_model,
        build_optimizers,
        cut_micro_batches,
        resolve_device,
    )
    from ampdoctor.probe.callsite import CallSiteFinder
    from ampdoctor.spec import load_spec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    spec = load_spec(spec_path)
    code = UserCode(spec, CallSiteFinder([spec.root, spec.spec_dir]))
    device = resolve_device(spec.device)
    data = cut_micro_batches(code.call("data", code.data_factory), spec)
    model = build_model(code, device, spec.seed)
    optimizer, _ = build_optimizers(code, model)
    settings = RunSettings(precision="fp32", device=device, device_type=device.type,
                           autocast_dtype=AUTOCAST_DTYPES["fp32"],
                           accumulation_steps=spec.accumulation_steps,
                           max_grad_norm=spec.max_grad_norm, rank=rank, world_size=world_size,
                           optimizer_steps=spec.optimizer_steps)
    code.train_loop(DistributedDataParallel(model), optimizer,
                    [shard(mb, rank, world_size) for mb in data], settings)
    dist.destroy_process_group()


def plain_seconds(config: Path, world_size: int) -> float:
    import torch.multiprocessing as mp

    from ampdoctor.ddp.launch import free_port

    started = time.perf_counter()
    mp.start_processes(_plain_rank, args=(world_size, str(config), free_port()),
                       nprocs=world_size, join=True, start_method="spawn")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "sample_configs/healthy_sgd_ddp.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from ampdoctor.spec import load_spec

    world_size = load_spec(args.config).ddp.world_size
    rung, plain = [], []
    for _ in range(args.repeats):
        rung.append(rung_seconds(args.config))
        plain.append(plain_seconds(args.config, world_size))
    r, p = statistics.median(rung), statistics.median(plain)
    print(f"config: {args.config.name}  world_size: {world_size}  repeats: {args.repeats}")
    print(f"ddp-sync rung (record's seconds): median {r:.2f} s  runs {[round(x, 2) for x in rung]}")
    print(f"plain {world_size}-process DDP run:  median {p:.2f} s  "
          f"runs {[round(x, 2) for x in plain]}")
    print(f"ratio: {r / p:.2f}x")


if __name__ == "__main__":
    main()
