"""A training script written as accelerate's documentation writes gradient accumulation:
`Accelerator(gradient_accumulation_steps=K)`, the step inside `with accelerator.accumulate(model)`,
`accelerator.backward(loss)` (which divides by K itself there), the optimizer stepped and zeroed
every micro-batch (accelerate skips the steps until the window is full).

`--bug double-average` also divides the loss by K in the loop: the gradient is averaged twice.

Run as `python accelerate_loop.py --gradient_accumulation_steps 4 --per_device_train_batch_size 8`.
"""
import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
parser.add_argument("--per_device_train_batch_size", type=int, default=8)
parser.add_argument("--mixed_precision", default="bf16", choices=["no", "bf16", "fp16"])
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--bug", default="none", choices=["none", "double-average"])
args = parser.parse_args()

accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                          mixed_precision=args.mixed_precision)
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
features = torch.randn(512, 16, generator=g)
targets = features[:, :1] * 0.3 + 0.1
loader = DataLoader(TensorDataset(features, targets), batch_size=args.per_device_train_batch_size,
                    shuffle=False)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

model.train()
for inputs, labels in loader:
    with accelerator.accumulate(model):
        loss = nn.functional.mse_loss(model(inputs).float(), labels)
        if args.bug == "double-average":
            loss = loss / args.gradient_accumulation_steps
        accelerator.backward(loss)  # BUG: double-average
        optimizer.step()
        optimizer.zero_grad()
