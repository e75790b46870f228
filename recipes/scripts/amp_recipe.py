"""The PyTorch AMP recipe with gradient accumulation, as a command-line script (argparse).

Run as `python amp_recipe.py --accum-steps 4 --batch-size 8`; its bugs are chosen with `--bug`
(none by default), so each broken variant is this same unmodified script run with other args.
"""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--max-grad-norm", type=float, default=1.0)
parser.add_argument("--amp", action="store_true", help="train in fp16 with a GradScaler")
parser.add_argument("--bug", default="none")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
opt = torch.optim.SGD(net.parameters(), lr=args.lr)
scaler = torch.amp.GradScaler(device, enabled=args.amp)
loss_fn = nn.MSELoss(reduction="sum" if args.bug == "reduction-sum" else "mean")

# a fixed data set, taken in order
data = torch.randn(512, 32, generator=torch.Generator().manual_seed(1))
target = data[:, :1] * 0.5 + 0.1
K = args.accum_steps

for _epoch in range(args.epochs):
    for i in range(len(data) // args.batch_size):
        x = data[i * args.batch_size:(i + 1) * args.batch_size].to(device)
        y = target[i * args.batch_size:(i + 1) * args.batch_size].to(device)
        if args.bug == "zero-grad-inside":
            opt.zero_grad()  # BUG: zero-grad-inside-accumulation
        with torch.autocast(device_type=device, dtype=torch.float16, enabled=args.amp):
            output = net(x)
            loss = loss_fn(output, y)
        if args.bug != "no-average":
            loss = loss / K
        if args.bug == "double-average":
            loss = loss / K
        # with --bug no-average / double-average / reduction-sum:
        scaler.scale(loss).backward()  # BUG: missing-accumulation-average # BUG: double-average # BUG: reduction-mismatch
        if (i + 1) % K == 0:
            if args.bug == "clip-before-unscale":
                nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm)  # BUG: clip-before-unscale
                scaler.unscale_(opt)
            else:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm)
            scaler.step(opt)  # BUG: loop-error (with --bug no-update)
            if args.bug != "no-update":
                scaler.update()
            opt.zero_grad(set_to_none=True)
