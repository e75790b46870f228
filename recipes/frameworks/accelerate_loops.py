"""HF accelerate loops written the way accelerate's gradient-accumulation guide writes them:
`Accelerator(gradient_accumulation_steps=K)`, `prepare`, `with accelerator.accumulate(model)`,
`accelerator.backward(loss)` (which divides by K itself), clipping on `sync_gradients`, and a
step / scheduler step / zero_grad on every micro-batch that accelerate turns into one per window."""

import torch
import torch.nn.functional as F
from accelerate import Accelerator

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))


def healthy(model, optimizer, micro_batches, run):
    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[run.precision],
                              gradient_accumulation_steps=run.accumulation_steps, cpu=True)
    scheduler = warmup(optimizer)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model.train()
    for inputs, targets in micro_batches:
        with accelerator.accumulate(model):
            outputs = model(inputs)
            loss = F.mse_loss(outputs, targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def double_average(model, optimizer, micro_batches, run):
    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[run.precision],
                              gradient_accumulation_steps=run.accumulation_steps, cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    for inputs, targets in micro_batches:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(inputs), targets)
            accelerator.backward(loss / run.accumulation_steps)  # BUG: double-average
            optimizer.step()
            optimizer.zero_grad()


def scheduler_not_prepared(model, optimizer, micro_batches, run):
    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[run.precision],
                              gradient_accumulation_steps=run.accumulation_steps, cpu=True)
    scheduler = warmup(optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)   # the scheduler is not prepared
    model.train()
    for inputs, targets in micro_batches:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()  # BUG: scheduler-per-microbatch
            optimizer.zero_grad()


def no_trainer(model, optimizer, micro_batches, run):
    """transformers' examples/pytorch/*_no_trainer.py: `get_scheduler` sized in optimizer
    steps, the scheduler handed to `accelerator.prepare` with the rest, and inside
    `accelerator.accumulate(model)` a backward, `optimizer.step()`, `lr_scheduler.step()` and
    `optimizer.zero_grad()` on every batch (accelerate makes them act once per window)."""
    from transformers import get_scheduler

    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[run.precision],
                              gradient_accumulation_steps=run.accumulation_steps, cpu=True)
    lr_scheduler = get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=10,
                                 num_training_steps=100)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    model.train()
    for batch in micro_batches:
        with accelerator.accumulate(model):
            inputs, targets = batch
            loss = F.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
