"""A token-level LM loop watched by `ampdoctor.watch` with a token-weighted `loss_fn` (docs/watch.md):
micro-batches of padded sequences whose real lengths differ (labels -100 on the padding), K
micro-batches per optimizer step. The healthy loop sums each micro-batch's token losses and
divides by the real tokens of the whole window, counted before the window (what transformers'
`num_items_in_batch` does). `bug` plants a mistake on the line marked `# BUG: <kind>`
(tests/test_watch_tokens.py reads them).
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor

IGNORE, VOCAB, LENGTH = -100, 40, 12
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class TinyLM(nn.Module):
    def __init__(self, width=32, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.drop(self.embed(tokens))))


def corpus(micro_batches, rows, seed=3, ragged=True):
    """`micro_batches` dicts of `rows` sequences; real lengths drawn per micro-batch (from 2
    to LENGTH when `ragged`, else all LENGTH), the rest padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro_batches):
        tokens = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
        labels = torch.roll(tokens, -1, dims=1)
        real = int(torch.randint(2, LENGTH + 1, (1,), generator=g)) if ragged else LENGTH
        labels[:, real:] = IGNORE
        out.append({"tokens": tokens, "labels": labels})
    return out


def token_loss_sum(model, batch):
    """The micro-batch's summed token loss and its real tokens: the `loss_fn` of the watch."""
    logits = model(batch["tokens"]).float()
    loss_sum = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                               ignore_index=IGNORE, reduction="sum")
    return loss_sum, int((batch["labels"] != IGNORE).sum())


def train(bug="none", precision="fp32", steps=6, K=4, rows=4, watched=True, every=2,
          ragged=True, dropout=0.1, on_error="warn", out=None):
    torch.manual_seed(0)
    model = TinyLM(dropout=dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    dtype = DTYPES.get(precision)
    batches = corpus(steps * K, rows, ragged=ragged)
    watch = ampdoctor.watch(model, opt, scaler=scaler, accumulation_steps=K,
                            loss_fn=token_loss_sum, every=every, on_error=on_error, out=out,
                            name=f"token_loop {bug} {precision}") if watched else None
    with watch if watch is not None else contextlib.nullcontext():
        micro_batches = watch.batches(batches) if watch is not None else batches
        window_tokens = 0
        for i, batch in enumerate(micro_batches):
            if i % K == 0:       # the window's real tokens, counted before it starts
                window_tokens = sum(int((b["labels"] != IGNORE).sum()) for b in batches[i:i + K])
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                logits = model(batch["tokens"])
            logits = logits.float().reshape(-1, VOCAB)
            labels = batch["labels"].reshape(-1)
            if bug == "weighted-average-mismatch":
                loss = F.cross_entropy(logits, labels, ignore_index=IGNORE) / K
            elif bug == "missing-accumulation-average":
                loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
            else:
                loss = F.cross_entropy(logits, labels, ignore_index=IGNORE,
                                       reduction="sum") / window_tokens
            if bug == "double-average":
                loss = loss / K
            scaler.scale(loss).backward()  # BUG: weighted-average-mismatch # BUG: missing-accumulation-average # BUG: double-average
            if (i + 1) % K == 0:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
    return model, watch
