"""A BatchNorm CNN accumulating K = 4 micro-batches of 8 images, each normalised over its own 8
(not the window's 32). `--no-average` is the bug: the loss not divided by K."""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum-steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--amp-dtype", choices=["bfloat16", "float16"], default="float16")
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--no-average", action="store_true")
    return p.parse_args()


def main():
    args = get_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    images = torch.randn(256, 3, 8, 8, generator=g)
    labels = torch.randint(0, 5, (256,), generator=g)
    loader = DataLoader(TensorDataset(images, labels), batch_size=args.batch_size, shuffle=False)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                          nn.Flatten(), nn.Linear(32, 5)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    amp_dtype = getattr(torch, args.amp_dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp_dtype == "float16")
    accum = args.grad_accum_steps

    model.train()
    for _epoch in range(args.epochs):
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=amp_dtype):
                out = model(x)
                loss = criterion(out, y)
            if not args.no_average:
                loss = loss / accum
            scaler.scale(loss).backward()  # BUG: missing-accumulation-average
            if (i + 1) % accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
