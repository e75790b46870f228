"""A plain accumulation loop ported onto a DeepSpeed engine: the config keeps
`gradient_accumulation_steps` at 1 (`--deepspeed_config deepspeed_loop_accumulation.json`) and
the loop accumulates K micro-batches itself (`--accum`), dividing the loss by K and calling
`engine.step()` once per window -- healthy: the engine neither divides nor steps at a boundary
of its own. ampdoctor takes K from the micro-batches the loop fed before the first update.

`--bug missing-average`: BROKEN, the division is dropped: with the config's K at 1 the engine
does not divide either, so the update is the sum of the K micro-batch gradients (4x at K = 4).
"""
import argparse

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--accum", type=int, default=4)
parser.add_argument("--bug", default="none", choices=["none", "missing-average"])
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
data = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
target = data[:, :1] * 0.3
engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                               model_parameters=model.parameters())
b = engine.train_micro_batch_size_per_gpu()
for i in range(len(data) // b):
    x, y = data[i * b:(i + 1) * b], target[i * b:(i + 1) * b]
    loss = F.mse_loss(engine(x).float(), y)
    if args.bug != "missing-average":
        loss = loss / args.accum
    engine.backward(loss)  # BUG: missing-accumulation-average
    if (i + 1) % args.accum == 0:
        engine.step()
