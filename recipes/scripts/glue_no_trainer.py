"""The loop of transformers' examples/pytorch/text-classification/run_glue_no_trainer.py (and
diffusers' train_*.py) kept as written, on a tiny regression model and local data:
`Accelerator(gradient_accumulation_steps=...)`, `with accelerator.accumulate(model):`, the
scheduler prepared by accelerate and stepped on every batch, `completed_steps` and the clip and
EMA update gated by `accelerator.sync_gradients`. 88 rows in batches of 8: 11 batches an epoch,
windows of 4, 4 and 3 with K = 4 (accelerate syncs at the dataloader's end and divides by K).

--bug: sched-unprepared (the scheduler not given to accelerator.prepare: it steps on every
micro-batch), clip-every-mb (clip_grad_norm_ outside the sync_gradients gate)."""
import argparse
import math

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import get_scheduler

parser = argparse.ArgumentParser()
parser.add_argument("--per_device_train_batch_size", type=int, default=8)
parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
parser.add_argument("--num_train_epochs", type=int, default=2)
parser.add_argument("--learning_rate", type=float, default=5e-3)
parser.add_argument("--num_warmup_steps", type=int, default=2)
parser.add_argument("--mixed_precision", default="no")
parser.add_argument("--max_grad_norm", type=float, default=1.0)
parser.add_argument("--rows", type=int, default=88)
parser.add_argument("--bug", default="none")
args = parser.parse_args()

accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                          mixed_precision=args.mixed_precision)
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
features = torch.randn(args.rows, 16, generator=g)
targets = features[:, :1] * 0.3 + 0.1
train_dataloader = DataLoader(TensorDataset(features, targets),
                              batch_size=args.per_device_train_batch_size, shuffle=False)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
ema = torch.optim.swa_utils.AveragedModel(
    model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
lr_scheduler = get_scheduler(name="linear", optimizer=optimizer,
                             num_warmup_steps=args.num_warmup_steps,
                             num_training_steps=max_train_steps)
if args.bug == "sched-unprepared":
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
else:
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)

completed_steps = 0
for epoch in range(args.num_train_epochs):  # noqa: B007 (as the example writes it)
    model.train()
    for step, (inputs, labels) in enumerate(train_dataloader):  # noqa: B007
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs).float(), labels)
            accelerator.backward(loss)
            if args.bug == "clip-every-mb":
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # BUG: gradient-mismatch
            elif accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()  # BUG: scheduler-per-microbatch
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            ema.update_parameters(model)
            completed_steps += 1
        if completed_steps >= max_train_steps:
            break
