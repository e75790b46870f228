"""A Fabric loop watched by `ampdoctor.watch` the documented way (docs/watch.md): the objects
`fabric.setup` returns are handed to the sentinel as they are, `fabric.backward` under
`fabric.no_backward_sync` for the first K-1 micro-batches. `bug` plants a classic mistake, marked
`# BUG: <kind>` on its line (tests/test_watch_lightning.py reads it).
"""

import contextlib

import torch
import torch.nn as nn
from lightning.fabric import Fabric

import ampdoctor


def train(bug="none", precision="32-true", steps=8, K=4, b=8, watched=True, every=3):
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.randn(steps * K * b, 16, generator=torch.Generator().manual_seed(1))
    batches = [(data[i:i + b], data[i:i + b, :1] * 0.5) for i in range(0, len(data), b)]

    def loss_fn(module, batch):             # one micro-batch's loss, as the loop computes it
        x, y = batch
        return nn.functional.mse_loss(module(x).float(), y)

    watch = ampdoctor.watch(model, optimizer, accumulation_steps=K, loss_fn=loss_fn,
                            scaler=getattr(fabric.strategy.precision, "scaler", None),
                            every=every, name=f"fabric {bug}") if watched else None
    with watch if watch is not None else contextlib.nullcontext():
        micro_batches = watch.batches(batches) if watch is not None else batches
        for i, (x, y) in enumerate(micro_batches):
            last = (i + 1) % K == 0
            with fabric.no_backward_sync(model, enabled=not last):
                loss = nn.functional.mse_loss(model(x).float(), y)
                fabric.backward(loss if bug == "missing-accumulation-average" else loss / K)  # BUG: missing-accumulation-average
            if last:
                optimizer.step()
                optimizer.zero_grad()
    return model, watch
