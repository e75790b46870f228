"""A DeepSpeed training script written the way DeepSpeedExamples' cifar10_deepspeed.py writes one,
healthy: argparse with `deepspeed.add_config_arguments`, the config built in code from the
arguments (`--dtype`, `--stage`, `--accum`) and handed to `deepspeed.initialize(config=...)`
with the training data (DeepSpeed's own data loader), inputs cast to the dtype the engine runs
in, and on every micro-batch `engine.backward(loss)` / `engine.step()`: the engine divides the
loss by gradient_accumulation_steps and steps at its own boundary. K and the micro-batch are
options that feed the config (DeepSpeed-Chat's names). Tiny synthetic data, CPU.

`--bug double-average`: BROKEN, the loop also divides the loss by its K option (0.25x at K = 4).
`--bug scheduler-twice`: BROKEN, the loop steps the engine's WarmupLR on every micro-batch
besides `engine.step()`, which steps it at its boundary (5 steps of the schedule per window).
`--bug zero-grad-inside`: BROKEN, `engine.zero_grad()` on every micro-batch: only the window's
last micro-batch reaches the update.
"""
import argparse

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F


def add_argument():
    parser = argparse.ArgumentParser(description="toy")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--gradient_accumulation_steps", default=4, type=int)
    parser.add_argument("--per_device_train_batch_size", default=8, type=int)
    parser.add_argument("--bug", default="none",
                        choices=["none", "double-average", "scheduler-twice",
                                 "zero-grad-inside"])
    parser.add_argument("--clip", default=0.0, type=float)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "steps_per_print": 100000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 10}},
        "gradient_clipping": args.clip,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "initial_scale_power": 15},
        "zero_optimization": {"stage": args.stage},
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def main(args):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    features = torch.randn(512, 16, generator=g)
    labels = torch.randint(0, 4, (512,), generator=g)
    trainset = torch.utils.data.TensorDataset(features, labels)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset,
        config=get_ds_config(args))
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, targets = data[0].to(model_engine.device), data[1].to(model_engine.device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            if args.bug == "zero-grad-inside":
                model_engine.zero_grad()  # BUG: zero-grad-inside-accumulation
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), targets)
            if args.bug == "double-average":
                loss = loss / args.gradient_accumulation_steps
            model_engine.backward(loss)  # BUG: double-average
            model_engine.step()
            if args.bug == "scheduler-twice":
                lr_scheduler.step()  # BUG: scheduler-per-microbatch


if __name__ == "__main__":
    main(add_argument())
