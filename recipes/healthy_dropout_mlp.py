"""Healthy: the textbook loop on a model with dropout in train mode (spec model:
common:make_dropout_mlp). Dropout draws fresh masks on every forward; under the default
`dropout: align` ampdoctor runs every forward of micro-batch i under the same RNG state in each
run of the loop and in the reference, so the masks match and the model goes through the ladder
unchanged."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            pred = model(x)
            loss = criterion(pred.float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
