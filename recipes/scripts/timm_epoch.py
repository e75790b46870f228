"""The shape of timm's `train_one_epoch`, written for the tests: a NativeScaler-like class called
with `need_update`, `loss /= accum_steps` where the epoch's last, partial window divides by its
own count (`last_accum_steps`), `model.no_sync()` when there is one, zero_grad after each update,
a warm-up counted in updates (`lr_scheduler.step_update(num_updates)`). 100 rows in micro-batches
of 8 make 13 micro-batches an epoch: with K = 4, windows of 4, 4, 4 and 1; its reference (K = 1,
batch 32) reads 32, 32, 32 and 4 rows, so `--steps 4` compares the partial window too.

Run as `python timm_epoch.py --amp --clip-grad 1.0`; `--bug` picks a variant:
- `last-window-full-k`: the partial window is divided by K too, as most loops and accelerate's
  `backward` do: its update is n/K of its window's mean (n of its micro-batches), each
  micro-batch weighing 1/K as in every window. Healthy, with a note saying so;
- `no-last-update`: the partial window never steps (the `last_batch` condition left out): the
  zero_grad at the next epoch's top wipes its gradient, and the step after it trains on the
  next epoch's first window (zero-grad-inside-accumulation at that zero_grad, judged against
  the partial window, with its real count of micro-batches). `--rows 88` (windows 4, 4, 3)
  shows it at step 2; `--rows 80` (4, 4, 2) steps anyway, since timm's own `(batch_idx + 1) %
  last_accum_steps` holds there;
- `updates-per-batch`: `num_updates` counts micro-batches, so the warm-up set once per update
  runs K times too fast (gradient-mismatch of the learning rate from step 1).
"""
import argparse
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class NativeScaler:
    def __init__(self, device="cuda"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
                 create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            self._scaler.step(optimizer)
            self._scaler.update()


def dispatch_clip_grad(parameters, value, mode="norm", norm_type=2.0):
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)


class WarmupScheduler:
    """step_update(num_updates): linear warm-up counted in optimizer updates."""

    def __init__(self, optimizer, warmup_t):
        self.optimizer = optimizer
        self.base = [g["lr"] for g in optimizer.param_groups]
        self.warmup_t = warmup_t
        self.step_update(0)

    def step_update(self, num_updates, metric=None):
        f = min(1.0, (num_updates + 1) / (self.warmup_t + 1))
        for g, b in zip(self.optimizer.param_groups, self.base, strict=True):
            g["lr"] = b * f  # BUG: gradient-mismatch (with --bug updates-per-batch)


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, lr_scheduler=None,
                    amp_autocast=suppress, loss_scaler=None):
    has_no_sync = hasattr(model, "no_sync")
    accum_steps = args.grad_accum_steps
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    model.train()
    optimizer.zero_grad()  # BUG: zero-grad-inside-accumulation (with --bug no-last-update)
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = ((last_batch and args.bug != "no-last-update")
                       or (batch_idx + 1) % accum_steps == 0)
        if batch_idx >= last_batch_idx_to_accum and args.bug != "last-window-full-k":
            accum_steps = last_accum_steps

        def _forward(input=input, target=target, accum_steps=accum_steps):
            with amp_autocast():
                output = model(input)
                loss = loss_fn(output, target)
            if accum_steps > 1:
                loss /= accum_steps
            return loss

        def _backward(_loss, need_update=need_update):
            if loss_scaler is not None:
                loss_scaler(_loss, optimizer, clip_grad=args.clip_grad, clip_mode=args.clip_mode,
                            parameters=model.parameters(), need_update=need_update)
            else:
                _loss.backward()
                if need_update:
                    if args.clip_grad is not None:
                        dispatch_clip_grad(model.parameters(), args.clip_grad, mode=args.clip_mode)
                    optimizer.step()

        if has_no_sync and not need_update:
            with model.no_sync():
                loss = _forward()
                _backward(loss)
        else:
            loss = _forward()
            _backward(loss)
        if args.bug == "updates-per-batch":
            num_updates += 1
        if not need_update:
            continue
        if args.bug != "updates-per-batch":
            num_updates += 1
        optimizer.zero_grad()
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates)
    return num_updates


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-b", "--batch-size", type=int, default=8)
    p.add_argument("--grad-accum-steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup-updates", type=int, default=5)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--clip-mode", default="norm")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--amp-dtype", default="float16")
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--bug", default="none")
    args = p.parse_args()
    device = "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    amp_autocast, loss_scaler = suppress, None
    if args.amp:
        dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
        amp_autocast = partial(torch.autocast, device_type=device, dtype=dtype)
        if dtype == torch.float16:
            loss_scaler = NativeScaler(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.rows, 16, generator=g)
    y = torch.randint(0, 4, (args.rows,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=False)
    sched = WarmupScheduler(optimizer, args.warmup_updates)
    for epoch in range(args.epochs):
        train_one_epoch(epoch, model, loader, optimizer, nn.CrossEntropyLoss(), args, sched,
                        amp_autocast, loss_scaler)


if __name__ == "__main__":
    main()
