"""A classifier trained the way fine-tuning scripts set their learning rate: a base rate scaled
linearly by the batch (`lr = blr * batch / 256`) and a linear warm-up over the first tenth of
the training's optimizer steps (or, `--schedule cosine`, a cosine decay over them), with
gradient accumulation in bf16.

`--lr-batch micro-batch` scales the rate by the micro-batch alone (the effective batch is
`batch_size * accum_iter`); `--schedule-steps micro-batches` counts the schedule's steps in
micro-batches (`len(loader)`), not in optimizer steps. Each makes every update differ from the
same training without accumulation, though every gradient matches it.

Run as `python lr_scaling.py --batch_size 8 --accum_iter 4`.
"""
import argparse
import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--accum_iter", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--blr", type=float, default=1e-3)
    parser.add_argument("--lr-batch", choices=["effective", "micro-batch"], default="effective")
    parser.add_argument("--schedule", choices=["warmup", "cosine"], default="warmup")
    parser.add_argument("--schedule-steps", choices=["optimizer-steps", "micro-batches"],
                        default="optimizer-steps")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=False,
                        drop_last=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

    eff_batch = args.batch_size * args.accum_iter
    if args.lr_batch == "micro-batch":
        eff_batch = args.batch_size
    lr = args.blr * eff_batch / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # BUG: gradient-mismatch
    total = args.epochs * len(loader)
    if args.schedule_steps == "optimizer-steps":
        total //= args.accum_iter
    warmup = max(1, total // 10)
    if args.schedule == "warmup":
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup))
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    criterion = nn.CrossEntropyLoss()

    for _epoch in range(args.epochs):
        for step, (inputs, labels) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = criterion(model(inputs), labels) / args.accum_iter
            loss.backward()
            if (step + 1) % args.accum_iter == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()  # BUG: schedule-pace
                optimizer.zero_grad()


if __name__ == "__main__":
    main()
