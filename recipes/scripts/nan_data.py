"""A plain fp32/fp16 loop over a tensor data set; `--bug nan-row` puts a NaN into one input row of
the first window (a corrupted sample), so the script's own fp32 training diverges: ampdoctor says
so (exit 3, at the backward), as for a spec whose reference is not finite, instead of calling two
NaN runs "not repeatable". Without it the script is healthy."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--amp", action="store_true")
parser.add_argument("--bug", default="none")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
Y = X.sum(1, keepdim=True)
if args.bug == "nan-row":
    X[3, 2] = float("nan")
K, b = args.accum_steps, args.batch_size
for i in range(len(X) // b):
    with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
        loss = nn.functional.mse_loss(model(X[i * b:(i + 1) * b]), Y[i * b:(i + 1) * b]) / K
    scaler.scale(loss).backward()  # BUG: not finite (with --bug nan-row)
    if (i + 1) % K == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
