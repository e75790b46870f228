"""A GAN-style script: two models (a generator and a discriminator), each with its own optimizer,
both accumulating over K micro-batches of real data. Each micro-batch runs the discriminator on
real and generated rows (its loss backward into D), then the generator through the
discriminator (its loss backward into G); every K micro-batches both optimizers step.

Run as `python gan.py --accum 4 --batch-size 8`; `--bug g-no-average` / `d-no-average` leaves
one model's loss undivided by K.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--accum", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--bug", default="none", choices=["none", "g-no-average", "d-no-average"])
args = parser.parse_args()

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=args.lr)
opt_d = torch.optim.Adam(D.parameters(), lr=args.lr)
real = torch.randn(512, 8, generator=torch.Generator().manual_seed(1)) * 0.5 + 1.0
noise = torch.randn(512, 4, generator=torch.Generator().manual_seed(2))
K, b = args.accum, args.batch_size

for i in range(len(real) // b):
    x, z = real[i * b:(i + 1) * b], noise[i * b:(i + 1) * b]
    fake = G(z)
    d_loss = (F.binary_cross_entropy_with_logits(D(x), torch.ones(b, 1))
              + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(b, 1)))
    if args.bug != "d-no-average":
        d_loss = d_loss / K
    d_loss.backward()  # BUG: missing-accumulation-average (with --bug d-no-average)
    D.requires_grad_(False)                    # the generator's loss trains G only
    g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(b, 1))
    if args.bug != "g-no-average":
        g_loss = g_loss / K
    g_loss.backward()  # BUG: missing-accumulation-average (with --bug g-no-average)
    D.requires_grad_(True)
    if (i + 1) % K == 0:
        opt_d.step()
        opt_g.step()
        opt_d.zero_grad(set_to_none=True)
        opt_g.zero_grad(set_to_none=True)
