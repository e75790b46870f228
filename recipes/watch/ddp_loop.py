"""A DistributedDataParallel loop watched by `ampdoctor.watch` the documented way
(docs/watch.md): every rank trains on its own shard, the first K-1 backwards of a window under
`no_sync()`. `--bug` plants a classic mistake, marked `# BUG: <kind>` on its line
(tests/test_watch_ddp.py reads it).

Run it with `python -m torch.distributed.run --nproc-per-node 2 ddp_loop.py --bug none
--out DIR --result DIR`: each rank trains watched, then again unwatched from the same start, and
writes to `--result` its record and whether the weights ended bit-identical.
"""

import argparse
import contextlib
import gc
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ampdoctor


def train(bug, rank, world, watched, steps=8, K=4, b=8, out=None, every=3, precision="fp32"):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(world * steps * K * b, 16, generator=torch.Generator().manual_seed(1))
    mine = data[rank::world]                       # this rank's shard
    batches = [(mine[i:i + b], mine[i:i + b, :1] * 0.5) for i in range(0, len(mine), b)]
    criterion = nn.MSELoss()
    torch.manual_seed(100 + rank)                  # each rank its own dropout masks

    def loss_fn(module, batch):                    # one micro-batch's loss, as the loop's
        x, y = batch
        return criterion(module(x), y)

    watch = ampdoctor.watch(model, opt, accumulation_steps=K, loss_fn=loss_fn, every=every,
                            out=out, name=f"ddp_loop {bug}") if watched else None
    with watch if watch is not None else contextlib.nullcontext():
        micro_batches = watch.batches(batches) if watch is not None else batches
        for i, (x, y) in enumerate(micro_batches):
            last = (i + 1) % K == 0
            if bug == "zero-grad-inside-accumulation" and rank == 1:
                opt.zero_grad()  # BUG: zero-grad-inside-accumulation
            with model.no_sync() if not last else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = criterion(model(x).float(), y)
                if bug != "missing-accumulation-average":
                    loss = loss / K
                loss.backward()  # BUG: missing-accumulation-average
            if last:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return net, watch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", default="none")
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watched, watch = train(args.bug, rank, world, True, out=args.out,
                               precision=args.precision)
        plain, _ = train(args.bug, rank, world, False, precision=args.precision)
    identical = all(torch.equal(a, b) for a, b in zip(watched.state_dict().values(),
                                                      plain.state_dict().values(), strict=True))
    result = {"rank": rank, "identical": identical, "record": watch.record,
              "pid": os.getpid()}
    Path(args.result, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    # every rank done with its collectives, and the DDP wrappers (the watch holds one) gone,
    # before the process group: a wrapper outliving it can abort the process at exit
    dist.barrier()
    del watch, watched, plain
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
