"""nanoGPT-style loop (the next micro-batch is fetched before the backward) on padded token
batches: each micro-batch's loss is the mean over its own real tokens, then divided by K, so a
micro-batch with 5 tokens weighs as much as one with 60 and the step is not the per-token mean."""

from contextlib import nullcontext

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    gradient_accumulation_steps = run.accumulation_steps
    ctx = (nullcontext() if run.autocast_dtype is None
           else torch.amp.autocast(device_type=run.device_type, dtype=run.autocast_dtype))
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    it = iter(micro_batches)
    batch = next(it)
    model.train()
    while batch is not None:
        for _micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits = model(batch["input_ids"])
            logits = logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   batch["labels"].reshape(-1), ignore_index=-100)
            loss = loss / gradient_accumulation_steps
            batch = next(it, None)   # prefetch while the backward runs
            scaler.scale(loss).backward()  # BUG: weighted-average-mismatch
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
