"""Healthy: timm's train.py / timm.utils.NativeScaler. Clipping comes from the script's own
config (`clip_grad`, `clip_mode`), not from the triage's max_grad_norm; the loss scaler exists
only for float16 ("bfloat16 does not need it"), and on the window's last micro-batch it does
scale -> backward -> unscale_ -> dispatch_clip_grad -> step -> update."""

from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn

# --- the script's args (timm: --clip-grad 1.0 --clip-mode norm)
clip_grad = 1.0
clip_mode = 'norm'


def dispatch_clip_grad(parameters, value: float, mode: str = 'norm', norm_type: float = 2.0):
    """ Dispatch to gradient clipping method

    Args:
        parameters (Iterable): model parameters to clip
        value (float): clipping value/factor/norm, mode dependant
        mode (str): clipping mode, one of 'norm', 'value'
        norm_type (float): p-norm, default 2.0
    """
    if mode == 'norm':
        torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)
    elif mode == 'value':
        torch.nn.utils.clip_grad_value_(parameters, value)
    else:
        raise AssertionError(f"Unknown clip mode ({mode}).")


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device='cuda'):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(
            self,
            loss,
            optimizer,
            clip_grad=None,
            clip_mode='norm',
            parameters=None,
            create_graph=False,
            need_update=True,
    ):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


def train_loop(model, optimizer, micro_batches, run):
    device = run.device
    amp_dtype = run.autocast_dtype
    amp_autocast = suppress  # do nothing
    loss_scaler = None
    if amp_dtype is not None:
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if amp_dtype == torch.float16:
            # loss scaler only used for float16 (half) dtype, bfloat16 does not need it
            loss_scaler = NativeScaler(device=device.type)
    loss_fn = nn.MSELoss()

    loader = micro_batches if hasattr(micro_batches, "__len__") else list(micro_batches)
    accum_steps = run.accumulation_steps
    has_no_sync = hasattr(model, "no_sync")
    last_accum_steps = len(loader) % accum_steps
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps

    model.train()
    optimizer.zero_grad()
    num_updates = 0
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps

        def _forward(input=input, target=target, accum_steps=accum_steps):
            with amp_autocast():
                output = model(input)
                loss = loss_fn(output.float(), target)
            if accum_steps > 1:
                loss /= accum_steps
            return loss

        def _backward(_loss, need_update=need_update):
            if loss_scaler is not None:
                loss_scaler(
                    _loss,
                    optimizer,
                    clip_grad=clip_grad,
                    clip_mode=clip_mode,
                    parameters=model.parameters(),
                    need_update=need_update,
                )
            else:
                _loss.backward()
                if need_update:
                    if clip_grad is not None:
                        dispatch_clip_grad(model.parameters(), value=clip_grad, mode=clip_mode)
                    optimizer.step()

        if has_no_sync and not need_update:
            with model.no_sync():
                loss = _forward()
                _backward(loss)
        else:
            loss = _forward()
            _backward(loss)

        if not need_update:
            continue

        num_updates += 1
        optimizer.zero_grad()
