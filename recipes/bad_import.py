"""A training module that raises while it is imported: a module-level lookup of a
special-token id that the vocabulary does not have (KeyError at import time)."""

import torch

VOCAB = {"<unk>": 0, "<bos>": 1, "<eos>": 2}
PAD_ID = VOCAB["<pad>"]


def train_loop(model, optimizer, micro_batches, run):
    for step, (x, y) in enumerate(micro_batches):
        loss = torch.nn.functional.mse_loss(model(x), y) / run.accumulation_steps
        loss.backward()
        if (step + 1) % run.accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
