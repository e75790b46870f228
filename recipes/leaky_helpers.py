"""Healthy maths, hostile to the process tree: the loop starts processes it never ends, as real
training code does, and keeps them in a module global so nothing collects them:

- a DataLoader with `persistent_workers=True` (two worker processes, iterated once),
- a daemonic `multiprocessing` prefetcher (a child that sleeps forever),
- a helper started with `subprocess` (`sleep 300`).

Each holds the worker's stdout and stderr. With LEAK_HANG set the loop then hangs (never
reaching its first step): the timeout and signal paths. With LEAK_READY set, the file it names
is written once the helpers are up. Expected: healthy (exit 0), and nothing of it running once
ampdoctor has exited.
"""

import multiprocessing
import os
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

_KEEP: list = []


def _prefetch() -> None:
    while True:
        time.sleep(1)


def start_helpers() -> None:
    """Once per process: the processes a careless loop leaves behind."""
    if _KEEP:
        return
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True)
    next(iter(loader))
    child = multiprocessing.get_context("fork").Process(target=_prefetch, daemon=True)
    child.start()
    helper = subprocess.Popen(["sleep", "300"])
    _KEEP.extend([loader, child, helper])
    ready = os.environ.get("LEAK_READY")
    if ready:
        with open(ready, "w") as f:
            f.write(f"{os.getpid()}\n")


def train_loop(model, optimizer, micro_batches, run):
    start_helpers()
    while os.environ.get("LEAK_HANG"):
        time.sleep(0.1)
    K = run.accumulation_steps
    model.train()
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=torch.bfloat16,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(x).float(), y) / K
        loss.backward()
        if (step + 1) % K == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
