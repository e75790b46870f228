"""A small language-model script on ragged texts: sequences of different lengths, padded to a
fixed length with the padding's labels set to ignore_index (-100), taken in order. With
`--loss-average micro-batch` (the default) each micro-batch's loss is the mean over its own
tokens, divided by K, as transformers computed it before October 2024: a micro-batch of 6
tokens counts as much as one of 60. `--loss-average window` is the fix: the loss summed over the
tokens, divided by the real tokens of the whole optimizer step (`num_items_in_batch`).

Run as `python ragged_lm.py --grad-accum 4 --batch-size 2`.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--grad-accum", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.5)
parser.add_argument("--loss-average", choices=["micro-batch", "window"], default="micro-batch")
parser.add_argument("--amp", action="store_true")
args = parser.parse_args()

IGNORE, VOCAB, MAX_LEN = -100, 50, 32
device = "cuda" if torch.cuda.is_available() else "cpu"

# the corpus: texts bucketed by length (each pair of neighbours of similar length), padded
g = torch.Generator().manual_seed(3)
lengths = []
for _ in range(64):
    base = int(torch.randint(2, MAX_LEN - 2, (1,), generator=g))
    lengths += [base, max(1, base - int(torch.randint(0, 3, (1,), generator=g)))]
input_ids = torch.zeros(len(lengths), MAX_LEN, dtype=torch.long)
labels = torch.full((len(lengths), MAX_LEN), IGNORE, dtype=torch.long)
for row, n in enumerate(lengths):
    tokens = torch.randint(1, VOCAB, (n + 1,), generator=g)
    input_ids[row, :n] = tokens[:-1]
    labels[row, :n] = tokens[1:]

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.Tanh(),
                      nn.Linear(32, VOCAB)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
scaler = torch.amp.GradScaler(device, enabled=args.amp)
K, b = args.grad_accum, args.batch_size

for i in range(len(lengths) // b):
    x = input_ids[i * b:(i + 1) * b].to(device)
    y = labels[i * b:(i + 1) * b].to(device)
    first = (i // K) * K * b                       # the optimizer step's rows
    window_tokens = (labels[first:first + K * b] != IGNORE).sum()
    with torch.autocast(device, dtype=torch.float16, enabled=args.amp):
        logits = model(x)
    logits = logits.float().reshape(-1, VOCAB)
    if args.loss_average == "window":
        loss = F.cross_entropy(logits, y.reshape(-1), ignore_index=IGNORE,
                               reduction="sum") / window_tokens
    else:
        loss = F.cross_entropy(logits, y.reshape(-1), ignore_index=IGNORE) / K
    scaler.scale(loss).backward()  # BUG: weighted-average-mismatch
    if (i + 1) % K == 0:
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
