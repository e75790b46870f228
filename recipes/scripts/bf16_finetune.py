"""An image-classification fine-tune written as torchvision's reference scripts are: autocast
to `--amp-dtype` (bfloat16 by default), gradient accumulation over `--grad-accum-steps`
micro-batches, clipping after `scaler.unscale_`. Its GradScaler is enabled for fp16 only; with
`--bug scaler-always-on` it is built enabled whatever the dtype, so the default bf16 training
runs a loss scaler it does not need (half-open AMP: a warning, the updates still match).

Run as `python bf16_finetune.py --grad-accum-steps 4 --batch-size 8 [--amp-dtype float16]
[--bug scaler-always-on]`.
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--grad-accum-steps", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--amp-dtype", choices=["bfloat16", "float16"], default="bfloat16")
parser.add_argument("--clip-grad", type=float, default=1.0)
parser.add_argument("--bug", choices=["scaler-always-on"], default=None)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
g = torch.Generator().manual_seed(0)
images = torch.randn(256, 3, 8, 8, generator=g)
labels = torch.randint(0, 5, (256,), generator=g)
loader = DataLoader(TensorDataset(images, labels), batch_size=args.batch_size, shuffle=False)

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                      nn.Flatten(), nn.Linear(32, 5)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
criterion = nn.CrossEntropyLoss()
amp_dtype = getattr(torch, args.amp_dtype)
fp16 = amp_dtype == torch.float16
scaler = torch.amp.GradScaler(device.type, enabled=fp16 or args.bug == "scaler-always-on")  # BUG: half-open-amp (with --bug scaler-always-on)
accum = args.grad_accum_steps

model.train()
optimizer.zero_grad(set_to_none=True)
for i, (x, y) in enumerate(loader):
    x, y = x.to(device), y.to(device)
    with torch.autocast(device.type, dtype=amp_dtype):
        loss = criterion(model(x), y) / accum
    scaler.scale(loss).backward()
    if (i + 1) % accum == 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
