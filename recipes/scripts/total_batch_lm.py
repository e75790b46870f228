"""A GPT-style language-model script in the shape of build-nanogpt's `train_gpt2.py`: the
accumulation steps are not an option, the script derives them from the tokens per optimizer
step, `grad_accum_steps = total_batch_size // (B * T)`; a `DataLoaderLite` walks a token
stream; bf16 autocast, clip at 1.0, a cosine learning rate with warm-up set per step.

`--bug no-average` drops `loss = loss / grad_accum_steps`.

Run as `python total_batch_lm.py --total_batch_size 256 -B 4 -T 16`.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--total_batch_size", type=int, default=256, help="tokens per optimizer step")
parser.add_argument("-B", "--micro_batch_size", type=int, default=4)
parser.add_argument("-T", "--sequence_length", type=int, default=16)
parser.add_argument("--max_lr", type=float, default=6e-4)
parser.add_argument("--warmup_steps", type=int, default=2)
parser.add_argument("--max_steps", type=int, default=10)
parser.add_argument("--bug", choices=["none", "no-average"], default="none")
args = parser.parse_args()
B, T = args.micro_batch_size, args.sequence_length
assert args.total_batch_size % (B * T) == 0, "make sure total_batch_size is divisible by B * T"
grad_accum_steps = args.total_batch_size // (B * T)
print(f"total desired batch size: {args.total_batch_size} => grad accum steps: {grad_accum_steps}")

torch.manual_seed(1337)
VOCAB = 64
tokens = torch.randint(0, VOCAB, (60000,), generator=torch.Generator().manual_seed(0))


class DataLoaderLite:
    def __init__(self, B, T):
        self.B, self.T, self.current_position = B, T, 0

    def next_batch(self):
        B, T = self.B, self.T
        buf = tokens[self.current_position:self.current_position + B * T + 1]
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.current_position += B * T
        return x, y


class TinyGPT(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(T, d)
        self.block = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0,
                                                batch_first=True)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight          # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1))
        x = self.block(self.wte(idx) + self.wpe(pos), src_mask=mask, is_causal=True)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def get_lr(it):
    if it < args.warmup_steps:
        return args.max_lr * (it + 1) / args.warmup_steps
    ratio = (it - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return args.max_lr * 0.1 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * args.max_lr * 0.9


model = TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.max_lr, betas=(0.9, 0.95), eps=1e-8)
train_loader = DataLoaderLite(B, T)
for step in range(args.max_steps):
    optimizer.zero_grad()
    loss_accum = 0.0
    for _micro_step in range(grad_accum_steps):
        x, y = train_loader.next_batch()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            logits, loss = model(x, y)
        if args.bug != "no-average":
            loss = loss / grad_accum_steps
        loss_accum += loss.detach()
        loss.backward()  # BUG: missing-accumulation-average
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    lr = get_lr(step)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    optimizer.step()
    print(f"step {step:4d} | loss: {loss_accum.item():.6f} | lr {lr:.4e} | norm: {norm:.4f}")
