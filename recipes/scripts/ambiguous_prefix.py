"""An argparse script with --batch-size and --beta: `--b` is an ambiguous prefix of both
(tests/test_script_loop_shapes2.py); `--bat` a unique one."""
import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--beta", type=float, default=0.9)
p.add_argument("--accum-steps", type=int, default=4)
p.add_argument("--amp", action="store_true")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=args.beta)
scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
K, b = args.accum_steps, args.batch_size
for i in range(len(X) // b):
    x, y = X[i * b:(i + 1) * b], Y[i * b:(i + 1) * b]
    with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
        loss = nn.functional.cross_entropy(model(x), y) / K
    scaler.scale(loss).backward()
    if (i + 1) % K == 0:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
