"""A script with its whole training at module level, no function: bf16 autocast on the CPU (or
the GPU), no GradScaler, a fixed in-order data set. `--no-average` leaves out the division by
the accumulation steps (the classic missing average); `--fresh-data` draws a new random batch
at every step (data no reference run with another batch size can reproduce)."""

import sys

import torch

accum = int(sys.argv[sys.argv.index("--accum") + 1]) if "--accum" in sys.argv else 4
bs = int(sys.argv[sys.argv.index("--bs") + 1]) if "--bs" in sys.argv else 6
no_average = "--no-average" in sys.argv
fresh = "--fresh-data" in sys.argv   # draw a new random batch at every step
dev = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(5)
w_true = torch.randn(12, 3)
xs = torch.randn(600, 12)
ys = xs @ w_true + 0.01 * torch.randn(600, 3)
model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.SiLU(), torch.nn.Linear(24, 3))
model.to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

for i in range(len(xs) // bs):
    xb, yb = xs[i * bs:(i + 1) * bs].to(dev), ys[i * bs:(i + 1) * bs].to(dev)
    if fresh:
        xb = torch.randn(bs, 12, device=dev)
        yb = xb @ w_true
    with torch.autocast(dev, dtype=torch.bfloat16):
        out = model(xb)
    loss = torch.nn.functional.mse_loss(out.float(), yb)
    if not no_average:
        loss = loss / accum
    loss.backward()  # BUG: missing-accumulation-average (with --no-average)
    if (i + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
