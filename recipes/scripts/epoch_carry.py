"""A plain epoch loop stepping on `(i + 1) % K == 0` only, zero_grad after each step and
nowhere else: an epoch of 11 micro-batches (K = 4) leaves 3 unstepped, and their gradient is
carried into the next epoch's first window (7 micro-batches / K): gradient-mismatch naming
that window at step 2. `--fix` also steps on the epoch's last micro-batch (its short window
divided by K: healthy, with the note)."""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--accum-steps", type=int, default=4)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--rows", type=int, default=88)
p.add_argument("--fix", action="store_true")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(args.rows, 16, generator=g), torch.randint(0, 4, (args.rows,), generator=g)
loader = DataLoader(TensorDataset(X, Y), batch_size=args.batch_size)
K = args.accum_steps
for _epoch in range(args.epochs):
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y) / K
        loss.backward()
        if (i + 1) % K == 0 or (args.fix and i + 1 == len(loader)):
            opt.step()  # BUG: gradient-mismatch (without --fix)
            opt.zero_grad()
