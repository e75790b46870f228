"""A training script that trains in bf16 by default (`--precision bf16`: autocast to bfloat16,
its GradScaler built but disabled) and steps an LR schedule once per window after
`scaler.step(opt); scaler.update()`, the textbook order. Its GradScaler settings matter only in
fp16 (`--precision fp16`); with `--growth-interval 1` that scaler keeps skipping after its
scale settled, and the scheduler advances on every skip.

Run as `python bf16_scheduler.py --accum-steps 4 --batch-size 8 [--precision fp16]
[--growth-interval 1]`.
"""

import argparse
import math

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
parser.add_argument("--growth-interval", type=int, default=2000)
parser.add_argument("--total-steps", type=int, default=8)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
opt = torch.optim.SGD(net.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / args.total_steps))))
scaler = torch.amp.GradScaler(device, growth_interval=args.growth_interval,
                              enabled=args.precision == "fp16")
dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16
loss_fn = nn.MSELoss()

data = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
target = data[:, :1] * 0.5 + 0.1
K = args.accum_steps

for i in range(len(data) // args.batch_size):
    x = data[i * args.batch_size:(i + 1) * args.batch_size].to(device)
    y = target[i * args.batch_size:(i + 1) * args.batch_size].to(device)
    with torch.autocast(device_type=device, dtype=dtype, enabled=args.precision != "fp32"):
        loss = loss_fn(net(x).float(), y) / K
    scaler.scale(loss).backward()
    if (i + 1) % K == 0:
        scaler.step(opt)
        scaler.update()
        scheduler.step()  # BUG: scheduler-steps-on-skip (with --growth-interval 1 in fp16)
        opt.zero_grad(set_to_none=True)
