"""Healthy: a fairseq-style trainer step. The window's samples are collected in a list, each
forward returns a *summed* loss and its sample_size, the gradients are normalised by the window's
total sample_size after unscale_ (fairseq's `optimizer.multiply_grads(numer / sample_size)`),
then clipped and stepped. If GradScaler skipped the step (the scale went down in update()), the
gradients are dropped and the *same* window is recomputed at the new, lower scale -- at most
MAX_ATTEMPTS times -- so no window's data is lost to an overflow. In fp32/bf16 nothing is ever
skipped and every window is computed once."""

import torch
import torch.nn.functional as F

MAX_ATTEMPTS = 3
FP16_INIT_SCALE = 2.0 ** 7  # fairseq's --fp16-init-scale default (summed losses need a small scale)


def multiply_grads(optimizer, c):
    """Multiplies grads by a constant *c*."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.data.mul_(c)


def train_step(model, optimizer, scaler, samples, run):
    """Forward and backward over the window's samples; returns the window's sample_size."""
    sample_size = 0
    for sample in samples:
        src, target = sample
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            net_output = model(src)
            loss = F.mse_loss(net_output.float(), target, reduction="sum")
        sample_size_i = target.numel()
        scaler.scale(loss).backward()
        sample_size += sample_size_i
    return sample_size


def train_loop(model, optimizer, micro_batches, run):
    update_freq = run.accumulation_steps
    clip_norm = run.max_grad_norm or 0.0
    scaler = torch.amp.GradScaler(run.device_type, init_scale=FP16_INIT_SCALE,
                                  enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad()
    num_updates = 0
    samples = []
    for sample in micro_batches:
        samples.append(sample)
        if len(samples) < update_freq:
            continue

        for _attempt in range(MAX_ATTEMPTS):
            sample_size = train_step(model, optimizer, scaler, samples, run)
            scaler.unscale_(optimizer)
            multiply_grads(optimizer, 1.0 / (sample_size or 1.0))
            if clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            overflow = scaler.get_scale() < scale_before
            if not overflow:
                num_updates += 1
                break
            # NOTE: gradient overflow detected, ignoring gradient; retrying the window
            optimizer.zero_grad()
        optimizer.zero_grad()
        samples = []
