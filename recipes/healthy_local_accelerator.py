"""Healthy: an accelerate-style loop on the project's own `local_accel.accelerate_lite`
Accelerator (not Hugging Face accelerate): `accumulate()` decides the sync step, `backward()`
divides by gradient_accumulation_steps and scales, `clip_grad_norm_()` unscales then clips, and
the optimizer steps (scaler.step + update) and zeroes only on the sync step. The Accelerator's
GradScaler is the only loss-scale owner; `mixed_precision` here is not a second one."""

import torch.nn.functional as F

from local_accel.accelerate_lite import Accelerator


def train_loop(model, optimizer, micro_batches, run):
    accelerator = Accelerator(
        mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[run.precision],
        gradient_accumulation_steps=run.accumulation_steps,
        device_type=run.device_type,
    )
    model, optimizer = accelerator.prepare(model, optimizer)

    model.train()
    for batch in micro_batches:
        inputs, targets = batch
        with accelerator.accumulate(model):
            with accelerator.autocast():
                outputs = model(inputs)
            loss = F.mse_loss(outputs.float(), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients and run.max_grad_norm is not None:
                accelerator.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            accelerator.step(optimizer)
            accelerator.zero_grad(optimizer)
