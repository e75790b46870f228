"""A training script that compiles its model (`torch.compile`), with gradient accumulation and
optional fp16 autocast + GradScaler, as scripts that want speed write it.

Run as `python compiled_model.py --accum-steps 4 --batch-size 8`; `--bug no-average` leaves the
loss undivided by K. Under `ampdoctor diagnose` the compiled model runs eager in every run (each
run would compile anew): the updates, and the bug, are the same.
"""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--amp", action="store_true")
parser.add_argument("--bug", default="none")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
model = torch.compile(net)
opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
scaler = torch.amp.GradScaler(device, enabled=args.amp)

data = torch.randn(512, 32, generator=torch.Generator().manual_seed(1))
target = data[:, :1] * 0.5 + 0.1
K = args.accum_steps

for i in range(len(data) // args.batch_size):
    x = data[i * args.batch_size:(i + 1) * args.batch_size].to(device)
    y = target[i * args.batch_size:(i + 1) * args.batch_size].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16, enabled=args.amp):
        loss = nn.functional.mse_loss(model(x), y)
    if args.bug != "no-average":
        loss = loss / K
    scaler.scale(loss).backward()  # BUG: missing-accumulation-average
    if (i + 1) % K == 0:
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
