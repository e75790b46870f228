"""An accelerate loop watched by `ampdoctor.watch_accelerate` the documented way (docs/watch.md):
`Accelerator(gradient_accumulation_steps=K)`, `prepare`, `with accelerator.accumulate(model)`,
`accelerator.backward(loss)` (which divides by K itself), clipping on `sync_gradients`, and
`optimizer.step()` / `scheduler.step()` / `optimizer.zero_grad()` on every micro-batch as
accelerate's docs write them (the prepared objects act on the window's last one only). `bug`
plants a mistake on the line marked `# BUG: <kind>` (tests/test_watch_accelerate.py reads it):
dividing by K under `accelerator.backward`, `loss.backward()` past accelerate (no division),
`model.zero_grad()` on every micro-batch, a scheduler not prepared (stepped per micro-batch);
in fp16 on a GPU (accelerate builds its GradScaler only there) a clip past accelerate on the
scaled gradients, a scaler whose scale doubles after every finite step. `tail` adds a short
last window of that many micro-batches.
"""

import contextlib

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampdoctor


def loss_fn(model, batch):            # one micro-batch's loss, before accelerator.backward
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def train(bug="none", precision="fp32", steps=8, K=4, b=8, watched=True, every=3,
          on_error="warn", out=None, device="cpu", tail=0):
    torch.manual_seed(0)
    mixed = {"fp32": "no"}.get(precision, precision)
    if bug == "frequent-skips":       # a scale that doubles after every finite step
        accelerator = Accelerator(gradient_accumulation_steps=K, cpu=device == "cpu", mixed_precision=mixed, kwargs_handlers=[GradScalerKwargs(init_scale=2.0**16, growth_interval=1)])  # BUG: frequent-skips
    else:
        accelerator = Accelerator(gradient_accumulation_steps=K, cpu=device == "cpu",
                                  mixed_precision=mixed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    # `tail` micro-batches more than `steps` windows: a short last window (accelerate syncs
    # there at the dataloader's end and divides by K, as in every window)
    data = torch.randn((steps * K + tail) * b, 16, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data, data[:, :1] * 0.5), batch_size=b)
    if bug == "scheduler-per-microbatch":        # the scheduler left out of prepare
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                                  scheduler)
    watch = ampdoctor.watch_accelerate(accelerator, model, optimizer, scheduler=scheduler,
                                       loss_fn=loss_fn, every=every, on_error=on_error,
                                       out=out) if watched else None
    with watch if watch is not None else contextlib.nullcontext():
        for batch in watch.batches(loader) if watch is not None else loader:
            with accelerator.accumulate(model):
                if bug == "zero-grad-inside-accumulation":
                    model.zero_grad()  # BUG: zero-grad-inside-accumulation
                x, y = batch
                loss = F.mse_loss(model(x).float(), y)
                if bug == "double-average":
                    accelerator.backward(loss / K)  # BUG: double-average
                elif bug == "missing-accumulation-average":
                    loss.backward()  # BUG: missing-accumulation-average
                else:
                    accelerator.backward(loss)
                if accelerator.sync_gradients and bug == "clip-before-unscale":
                    # past accelerate: the fp16 gradients are still scaled here
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # BUG: clip-before-unscale
                elif accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()  # BUG: scheduler-per-microbatch
                optimizer.zero_grad()
    return accelerator.unwrap_model(model), watch
