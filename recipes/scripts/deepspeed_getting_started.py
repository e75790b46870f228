"""DeepSpeed getting-started style: argparse with `deepspeed.add_config_arguments`, the config
from `--deepspeed_config`, `engine.backward(loss)` / `engine.step()` on every micro-batch --
healthy with deepspeed_getting_started.json (K = 4).

`--bug double-average`: BROKEN, the loop divides the loss by the config file's
gradient_accumulation_steps (read by the script itself) before `engine.backward`, which divides
by it again: the engine consumes a quarter of the window's gradient at K = 4.

`--accum N` with deepspeed_loop_accumulation.json (K = 1 there): a plain accumulation loop ported
onto the engine, accumulating N micro-batches itself, dividing the loss by N and calling
`engine.step()` once per window -- healthy. `--bug missing-average` drops that division: the
engine does not divide at K = 1 either, so the update is the sum of the N gradients (4x at 4).
"""
import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--bug", default="none", choices=["none", "double-average", "missing-average"])
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
with open(args.deepspeed_config) as f:
    config_accumulation = json.load(f)["gradient_accumulation_steps"]

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
        if args.bug == "double-average":
            engine.backward(loss / config_accumulation)  # BUG: double-average
        elif args.accum > 1:
            if args.bug != "missing-average":
                loss = loss / args.accum
            engine.backward(loss)  # BUG: missing-accumulation-average
        else:
            engine.backward(loss)
        if (i + 1) % args.accum == 0:
            engine.step()
