"""Healthy: a tiny Transformer language model (embedding -> one TransformerEncoderLayer with its
default dropout=0.1 -> LM head) trained with correct accumulation. The loop calls model.train()
at its start, as every real loop does, so dropout is active during the triage."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 50
D_MODEL = 16
SEQ_LEN = 8
DATA_SEED = 1234


class TinyTransformerLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ_LEN, D_MODEL))
        self.layer = nn.TransformerEncoderLayer(d_model=D_MODEL, nhead=2, dim_feedforward=32,
                                                batch_first=True)
        self.lm_head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, input_ids):
        h = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        return self.lm_head(self.layer(h))


def make_model():
    return TinyTransformerLM()


def make_data(n_samples=96):
    """`(input_ids, labels)`, both n_samples x SEQ_LEN; labels are the next tokens."""
    g = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(0, VOCAB, (n_samples, SEQ_LEN + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(model, batch):
    """Mean next-token cross-entropy of one micro-batch (every micro-batch has the same count)."""
    input_ids, labels = batch
    logits = model(input_ids).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, (input_ids, labels) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            logits = model(input_ids)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
        scaler.scale(loss / K).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
