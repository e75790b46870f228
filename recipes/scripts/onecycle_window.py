"""OneCycleLR with total_steps = epochs * len(loader) // K, stepped once per window (healthy) or
on every micro-batch (--bug sched-per-mb: the schedule runs K x too fast, and OneCycleLR raises
once it passes total_steps, here in the 5th window: scheduler-per-microbatch at its step line,
read from the steps before the raise, not a bare loop-error)."""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--gradient-accumulation-steps", type=int, default=4)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--amp", action="store_true")
p.add_argument("--bug", default="none")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
loader = DataLoader(TensorDataset(X, Y), batch_size=args.batch_size, shuffle=False)
K = args.gradient_accumulation_steps
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2,
                                            total_steps=args.epochs * len(loader) // K)
scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
for _epoch in range(args.epochs):
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
            loss = nn.functional.cross_entropy(model(x), y) / K
        scaler.scale(loss).backward()
        if args.bug == "sched-per-mb":
            sched.step()  # BUG: scheduler-per-microbatch
        if (i + 1) % K == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if args.bug != "sched-per-mb":
                sched.step()
