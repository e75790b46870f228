"""A GPT-2-small-sized causal transformer built from torch modules (no downloaded weights):
12 layers, d_model 768, 12 heads, vocabulary 50257, tied embeddings -- 124M parameters -- and
a 4-layer, 256-wide version of the same code for a CPU machine."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 50257
CTX = 128


class GPT(nn.Module):
    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = VOCAB,
                 ctx: int = CTX):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight   # tied, as GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def make_small() -> nn.Module:
    return GPT()


def make_mini() -> nn.Module:
    return GPT(layers=4, d=256, heads=4)


def make_data(n: int = 256, ctx: int = 64):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n, ctx + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / K
        scaler.scale(loss).backward()
        if (i + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
