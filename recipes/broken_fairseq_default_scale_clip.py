"""Broken: the fairseq-style Trainer.train_step of healthy_fairseq_default_scale.py (summed token
losses, GradScaler's default init_scale) clips before unscale_: the norm it measures is the
scaled one, so it clips gradients that are within max_grad_norm in true units.

Each micro-batch's criterion returns a summed token loss and its sample_size (the real tokens);
the window's gradients are normalised once by the window's total sample_size
(`multiply_grads(1 / sample_size)`) after unscale_, then stepped. With summed losses the default
scale overflows fp16 for the first few updates until GradScaler's search finds a scale that fits:
in a slice of three optimizer steps *every* fp16 step is skipped, which is normal start-up, not a
bug -- and it would hide this clip. ampdoctor reruns the fp16 slice from the scale the search reached.
"""

import torch

from common import token_loss_sum


class Trainer:
    def __init__(self, model, optimizer, run):
        self.model = model
        self.optimizer = optimizer
        self.run = run
        self.scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    def multiply_grads(self, c):
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.data.mul_(c)

    def train_step(self, samples):
        self.model.train()
        self.optimizer.zero_grad()
        sample_size = 0.0
        for sample in samples:
            with torch.autocast(self.run.device_type, dtype=self.run.autocast_dtype,
                                enabled=self.run.autocast_dtype is not None):
                loss, sample_size_i = token_loss_sum(self.model, sample)
            self.scaler.scale(loss).backward()
            sample_size += float(sample_size_i)
        self.multiply_grads(1.0 / sample_size)
        if self.run.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.run.max_grad_norm)  # BUG: clip-before-unscale
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()


def train_loop(model, optimizer, micro_batches, run):
    trainer = Trainer(model, optimizer, run)
    chunk = []
    for sample in micro_batches:  # fairseq's GroupedIterator(itr, update_freq)
        chunk.append(sample)
        if len(chunk) == run.accumulation_steps:
            trainer.train_step(chunk)
            chunk = []
