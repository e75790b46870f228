"""The fix of `broken_scaler_per_step.py`: the same `train_step`, handed one GradScaler built
before the loop, so its scale and growth tracker live as long as the training. The second loop
rebuilds the scaler every step but restores the previous one's state (`load_state_dict`, as a
resume from a checkpoint does): the scale carries over, one state machine all along."""

import torch

from broken_scaler_per_step import train_step, windows


def train_loop(model, optimizer, micro_batches, run):
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    model.train()
    for window in windows(micro_batches, run.accumulation_steps):
        train_step(model, optimizer, window, run, scaler=scaler)


def restored_every_step(model, optimizer, micro_batches, run):
    state = None
    model.train()
    for window in windows(micro_batches, run.accumulation_steps):
        scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
        if state is not None:
            scaler.load_state_dict(state)
        train_step(model, optimizer, window, run, scaler=scaler)
        state = scaler.state_dict()
