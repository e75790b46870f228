"""BROKEN: a DeepSpeed getting-started script (argparse with `deepspeed.add_config_arguments`,
`--deepspeed_config deepspeed_double_average.json`) that divides the loss by the accumulation
steps itself before `engine.backward(loss)`, which divides by gradient_accumulation_steps
again: the engine consumes 1/K of the window's gradient (0.25x at K = 4) with nothing to see.
ampdoctor names double-average at the division's line (the line that hands the
engine the divided loss)."""
import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--epochs", type=int, default=1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
with open(args.deepspeed_config) as f:
    accumulation = json.load(f)["gradient_accumulation_steps"]

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
data = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
target = data[:, :1] * 0.3
engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                               model_parameters=model.parameters())
b = engine.train_micro_batch_size_per_gpu()
for _epoch in range(args.epochs):
    for i in range(len(data) // b):
        x, y = data[i * b:(i + 1) * b], target[i * b:(i + 1) * b]
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss / accumulation)  # BUG: double-average (the engine divides again)
        engine.step()
