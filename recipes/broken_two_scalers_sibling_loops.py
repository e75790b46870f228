"""Broken: one module, three loops. `train_loop` (the spec's) gives its auxiliary loss a
GradScaler of its own: both losses' gradients land in the one optimizer's parameters, which only
the main scaler unscales and steps, so the aux gradients keep the aux scaler's factor divided by
the main one's, and their skips and backoffs are decided by two state machines.
`pretrain_loop` and `finetune_loop` each build one GradScaler of their own, are never run by
this spec, and are not owners on `train_loop`'s path: the finding counts 2 owners, not 4, and
points into `train_loop`."""

import torch
import torch.nn as nn

AUX_WEIGHT = 0.5


def pretrain_loop(model, optimizer, micro_batches, run):
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    for x, y in micro_batches:
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    fp16 = run.precision == "fp16"
    scaler = torch.amp.GradScaler(run.device_type, enabled=fp16)  # BUG: double-scaling
    aux_scaler = torch.amp.GradScaler(run.device_type, enabled=fp16)
    model.train()
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            out = model(x).float()
            loss = nn.functional.mse_loss(out, y) / K
            aux = AUX_WEIGHT * out.pow(2).mean() / K
        scaler.scale(loss).backward(retain_graph=True)
        aux_scaler.scale(aux).backward()
        if (i + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


def finetune_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = nn.functional.mse_loss(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (i + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
