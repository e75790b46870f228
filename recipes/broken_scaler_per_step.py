"""A GradScaler built inside `train_step`, so every optimizer step gets a fresh one: the
loss-scale state machine restarts from init_scale at each step. A backoff never lasts (an
overflow at the initial scale comes back on every step, and no update is ever applied) and the
scale never grows (growth_interval good steps of one scaler never happen). The step function
itself is right: handed one scaler built before the loop (`healthy_scaler_passed_in.py`), the
same code is healthy."""

import torch
import torch.nn.functional as F

from common import make_regression_data


def train_step(model, optimizer, window, run, scaler=None):
    if scaler is None:
        scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")  # BUG: frequent-skips
    K = len(window)
    for x, y in window:
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = F.mse_loss(model(x).float(), y) / K
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if run.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def windows(micro_batches, K):
    micro_batches = list(micro_batches)
    return [micro_batches[s:s + K] for s in range(0, len(micro_batches), K)]


def train_loop(model, optimizer, micro_batches, run):
    model.train()
    for window in windows(micro_batches, run.accumulation_steps):
        train_step(model, optimizer, window, run)


def large_target_data():
    """Unnormalised regression targets (x 10): an fp16 gradient overflows at the default scale
    within the first steps. One persistent scaler backs off once to 32768 and stays there; a
    new scaler per step starts again from 65536 and overflows again, step after step."""
    x, y = make_regression_data(480)
    return x, 10.0 * y
