"""Healthy: nanoGPT's train.py inner loop. The first batch is fetched before the loop, and each
micro-step prefetches the *next* batch right after the forward ("immediately async prefetch next
batch while model is doing the forward pass on the GPU"), before the backward of the current one.
The window is still exactly the K micro-batches whose losses go into backward."""

from contextlib import nullcontext

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    gradient_accumulation_steps = run.accumulation_steps
    grad_clip = run.max_grad_norm if run.max_grad_norm is not None else 0.0  # clip gradients at this value, or disable if == 0.0
    device_type = run.device_type
    dtype = {'fp32': 'float32', 'bf16': 'bfloat16', 'fp16': 'float16'}[run.precision]
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
    ctx = nullcontext() if run.autocast_dtype is None else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    # initialize a GradScaler. If enabled=False scaler is a no-op
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
    ddp = hasattr(model, "no_sync")

    it = iter(micro_batches)
    X, Y = next(it)  # fetch the very first batch
    iter_num = 0
    model.train()
    while X is not None:
        # forward backward update, with optional gradient accumulation to simulate larger batch size
        # and using the GradScaler if data type is float16
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                # in DDP training we only need to sync gradients at the last micro step.
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            with ctx:
                logits = model(X)
                loss = F.mse_loss(logits.float(), Y)
                loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
            # immediately async prefetch next batch while model is doing the forward pass on the GPU
            X, Y = next(it, (None, None))
            # backward pass, with gradient scaling if training in fp16
            scaler.scale(loss).backward()
        # clip the gradient
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        # step the optimizer and scaler if training in fp16
        scaler.step(optimizer)
        scaler.update()
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
