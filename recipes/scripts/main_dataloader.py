"""A training script with a `main()`, argparse and a DataLoader (shuffled with a seeded
generator), fp16 autocast with a GradScaler switched by `--amp`, a warmup LR schedule that does not
advance on a step the scaler skipped.

`--bug` picks a classic mistake (none by default): `scheduler-per-microbatch` steps the
scheduler after every micro-batch, `step-per-microbatch` calls scaler.step on every micro-batch.
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 4))

    def forward(self, x):
        return self.body(x)


def parse_args():
    parser = argparse.ArgumentParser(description="train a small classifier")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--bug", default="none")
    return parser.parse_args()


def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    features = torch.randn(1024, 16)
    labels = (features[:, :4].argmax(1) + (features[:, 4] > 1).long()) % 4
    loader = DataLoader(TensorDataset(features, labels), batch_size=args.batch_size,
                        shuffle=True, generator=torch.Generator().manual_seed(3),
                        num_workers=args.workers)
    model = MLP(args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    scaler = torch.amp.GradScaler(device, enabled=args.amp)
    criterion = nn.CrossEntropyLoss()
    model.train()
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device, dtype=torch.float16, enabled=args.amp):
            loss = criterion(model(x), y) / args.grad_accum
        scaler.scale(loss).backward()
        if args.bug == "scheduler-per-microbatch":
            scheduler.step()  # BUG: scheduler-per-microbatch
        if args.bug == "step-per-microbatch":
            scaler.step(optimizer)  # BUG: step-per-microbatch
            scaler.update()
            optimizer.zero_grad()
            continue
        if (step + 1) % args.grad_accum == 0:
            scaler.step(optimizer)
            scale = scaler.get_scale()
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            skipped = scaler.get_scale() < scale   # the scaler backed off: no update was made
            if args.bug != "scheduler-per-microbatch" and not skipped:
                scheduler.step()


if __name__ == "__main__":
    main()
