"""Healthy: a recommender-style model whose embedding table has sparse gradients
(`nn.Embedding(sparse=True)`, stepped by `SparseAdam`) beside a dense head (the spec's Adam),
one GradScaler stepping both optimizers. Each gradient is a sparse tensor: ampdoctor compares,
norms and copies it densified (before, the first reference crashed with exit 4)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

ITEMS, DIM, HISTORY = 50, 8, 5


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(ITEMS, DIM, sparse=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.items(ids).mean(1))


def make_model():
    return Recommender()


def make_data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ITEMS, (96, HISTORY), generator=g)
    return ids, torch.randn(96, 1, generator=g)


def loss(model, batch):
    ids, y = batch
    return F.mse_loss(model(ids).float(), y)


def make_optimizer(model):
    return torch.optim.Adam(model.head.parameters(), lr=1e-3)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    sparse_optimizer = torch.optim.SparseAdam(list(model.items.parameters()), lr=1e-3)
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    for i, (ids, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            out = model(ids)
        scaler.scale(F.mse_loss(out.float(), y) / K).backward()
        if (i + 1) % K == 0:
            scaler.step(optimizer)
            scaler.step(sparse_optimizer)
            scaler.update()
            optimizer.zero_grad()
            sparse_optimizer.zero_grad()
