"""BROKEN: a DeepSpeed getting-started script whose config file
(`--deepspeed_config deepspeed_gradscaler.json`) enables DeepSpeed's fp16 loss scaler, with a
torch GradScaler of its own on top: two loss-scale state machines on one loss (double-scaling),
found from the script and the config file together, by `diagnose` as by `ampdoctor scan
deepspeed_gradscaler.py deepspeed_gradscaler.json`, whether or not the device runs fp16."""
import argparse

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
data = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
target = data[:, :1] * 0.3
engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                               model_parameters=model.parameters())
scaler = torch.amp.GradScaler("cpu")  # BUG: double-scaling
b = engine.train_micro_batch_size_per_gpu()
for i in range(len(data) // b):
    x, y = data[i * b:(i + 1) * b], target[i * b:(i + 1) * b]
    if engine.fp16_enabled():
        x = x.half()
    loss = F.mse_loss(engine(x).float(), y)
    engine.backward(scaler.scale(loss))
    engine.step()
