"""Mixed precision written with the CUDA-only API, as MAE, DeiT and Swin's training code write it:
`torch.cuda.amp.autocast()` and `torch.cuda.amp.GradScaler()`. On a machine without CUDA both
switch themselves off (with a warning) and the script trains in fp32: the reduced-precision rungs
are `skip`, saying the script's autocast is for cuda, not a half-open-amp error. On a GPU it is
the usual fp16 recipe with a scaler."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8)
parser.add_argument("--accum_iter", type=int, default=4)
parser.add_argument("--amp", action="store_true")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
criterion = nn.CrossEntropyLoss()
X = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (256,), generator=torch.Generator().manual_seed(2))
b, K = args.batch_size, args.accum_iter
optimizer.zero_grad()
for it in range(len(X) // b):
    x, y = X[it * b:(it + 1) * b].to(device), Y[it * b:(it + 1) * b].to(device)
    with torch.cuda.amp.autocast(enabled=args.amp):  # the autocast line
        loss = criterion(model(x), y) / K
    scaler.scale(loss).backward()
    if (it + 1) % K == 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
