"""The shape of MAE/DeiT fine-tuning (`engine_finetune.train_one_epoch`), written for the tests:
a NativeScaler-like class whose `update_grad` ends a window, `loss /= accum_iter`, the learning
rate set by hand from a fractional epoch at the start of each window (warm-up then cosine),
zero_grad at the top of the epoch and after each update, the rate scaled by the effective batch.

Run as `python mae_finetune.py --amp --clip_grad 1.0`; `--bug` picks a variant:
- `lr-every-iter`: the rate set on every micro-batch from the same fractional epoch: each step
  uses the rate of its window's last micro-batch, less than a step of the schedule later
  (harmless: healthy);
- `warmup-per-iter`: the fractional epoch counts micro-batches over optimizer steps per epoch,
  set on every micro-batch: the warm-up runs K times too fast (scheduler-per-microbatch).
"""
import argparse
import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class NativeScalerWithGradNormCount:
    def __init__(self, device, enabled):
        self._scaler = torch.amp.GradScaler(device, enabled=enabled)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, update_grad=True, bug="none"):
        self._scaler.scale(loss).backward()
        if update_grad:
            if clip_grad is not None:
                if bug != "clip-before-unscale":
                    self._scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            else:
                self._scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(parameters, float("inf"))
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            norm = None
        return norm


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (
            1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in optimizer.param_groups:
        g["lr"] = lr  # BUG: scheduler-per-microbatch (with --bug warmup-per-iter)
    return lr


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--accum_iter", type=int, default=4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--warmup_epochs", type=float, default=1)
    p.add_argument("--blr", type=float, default=1e-3)
    p.add_argument("--min_lr", type=float, default=1e-5)
    p.add_argument("--clip_grad", type=float, default=None)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--bug", default="none")
    args = p.parse_args()
    device = "cpu"
    eff = args.batch_size * args.accum_iter
    args.lr = args.blr * eff / 256
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    loss_scaler = NativeScalerWithGradNormCount(device, args.amp)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    y = torch.randint(0, 5, (512,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=False)
    accum_iter = args.accum_iter
    for epoch in range(args.epochs):
        model.train(True)
        optimizer.zero_grad()
        for data_iter_step, (samples, targets) in enumerate(loader):
            if args.bug == "warmup-per-iter":
                steps_per_epoch = len(loader) // accum_iter
                adjust_learning_rate(optimizer, (epoch * len(loader) + data_iter_step)
                                     / steps_per_epoch, args)
            elif args.bug == "lr-every-iter" or data_iter_step % accum_iter == 0:
                adjust_learning_rate(optimizer, data_iter_step / len(loader) + epoch, args)
            with torch.autocast(device, dtype=torch.float16, enabled=args.amp):
                outputs = model(samples)
                loss = criterion(outputs, targets)
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                raise SystemExit(1)
            if args.bug != "no-average":
                loss /= accum_iter
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters(),
                        update_grad=(data_iter_step + 1) % accum_iter == 0, bug=args.bug)
            if (data_iter_step + 1) % accum_iter == 0:
                optimizer.zero_grad()


if __name__ == "__main__":
    main()
