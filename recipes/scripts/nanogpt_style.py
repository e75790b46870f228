"""A nanoGPT-style training script: the configuration is module-level globals, overridden from
the command line as `--key=value` (nanoGPT's configurator), the loop is at module level, the
batch is drawn at random from a token stream, and on CPU the autocast context is a
`nullcontext()` (nanoGPT's `ctx`), so this script trains in fp32 there.
"""

import math
import sys
from ast import literal_eval
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F

# -----------------------------------------------------------------------------
batch_size = 4
block_size = 16
gradient_accumulation_steps = 4
learning_rate = 6e-3
max_iters = 100
weight_decay = 0.1
grad_clip = 1.0
warmup_iters = 2
dtype = "bfloat16"
device = "cuda" if torch.cuda.is_available() else "cpu"
# -----------------------------------------------------------------------------
for arg in sys.argv[1:]:   # the configurator: --key=value overrides a global above
    key, val = arg[2:].split("=")
    try:  # noqa: SIM105 - as nanoGPT writes it
        val = literal_eval(val)
    except (SyntaxError, ValueError):
        pass
    assert key in globals(), f"unknown config key {key}"
    globals()[key] = val

torch.manual_seed(1337)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type,
                                                                    dtype=ptdtype)

vocab_size = 64
data = torch.randint(vocab_size, (4096,), generator=torch.Generator().manual_seed(7))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, 32)
        self.wpe = nn.Embedding(block_size, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.mlp(self.ln(x))
        logits = self.head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


model = TinyGPT().to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    return learning_rate * 0.5 * (1 + math.cos(math.pi * it / max_iters))


X, Y = get_batch()
for iter_num in range(max_iters):
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    for micro_step in range(gradient_accumulation_steps):  # noqa: B007
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
