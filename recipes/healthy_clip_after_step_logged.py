"""Healthy: two clips that come after a step and are right. The backbone and the head have their
own optimizers; the head steps first, then the backbone's gradients are clipped and the
backbone steps (the clip is after *a* step, but before the step that consumes it). After both
steps the loop logs the gradient norm with `clip_grad_norm_(params, inf)`, which never clips."""

import math

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    backbone_opt, head_opt = optimizer
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    backbone, head = linears[0], linears[-1]
    logged = []

    model.train()
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = criterion(model(x).float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(head_opt)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(head.parameters(), run.max_grad_norm)
            scaler.step(head_opt)
            scaler.unscale_(backbone_opt)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(backbone.parameters(), run.max_grad_norm)
            scaler.step(backbone_opt)
            logged.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)))
            scaler.update()
            backbone_opt.zero_grad(set_to_none=True)
            head_opt.zero_grad(set_to_none=True)
    return logged
