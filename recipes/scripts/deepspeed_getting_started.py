"""DeepSpeed getting-started style: config from --deepspeed_config, engine.backward/step (script
mode does not drive a DeepSpeed engine yet: tests/test_script_infer.py checks what it says)."""
import argparse

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--epochs", type=int, default=1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

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
        engine.backward(loss)
        engine.step()
