"""A healthy AMP + accumulation script that starts processes it never ends, as real training
scripts do: a DataLoader with `persistent_workers=True`, a daemonic `multiprocessing`
prefetcher, and a `subprocess` helper (`sleep 300`). Each holds the stdout and stderr it was
given. `--hang` hangs before the first step (the timeout and signal paths); with LEAK_READY set,
the file it names is written once the helpers are up.

Expected: healthy (exit 0), and nothing it started running once ampdoctor has exited.
"""

import argparse
import multiprocessing
import os
import subprocess
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--accum-steps", type=int, default=2)
parser.add_argument("--hang", action="store_true")
args = parser.parse_args()


def prefetch() -> None:
    while True:
        time.sleep(1)


def main() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    data = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    target = data[:, :1] * 0.5
    loader = DataLoader(TensorDataset(data, target), batch_size=args.batch_size,
                        num_workers=2, persistent_workers=True)
    helper_proc = multiprocessing.get_context("fork").Process(target=prefetch, daemon=True)
    helper_proc.start()
    helper = subprocess.Popen(["sleep", "300"])
    ready = os.environ.get("LEAK_READY")
    if ready:
        with open(ready, "w") as f:
            f.write(f"{helper.pid}\n")
    if args.hang:
        next(iter(loader))           # the persistent workers up, then no step ever
    while args.hang:
        time.sleep(0.1)
    K = args.accum_steps
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(net(x), y) / K
        loss.backward()
        if (i + 1) % K == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
