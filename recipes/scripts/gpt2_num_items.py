"""A tiny GPT-2 on ragged texts, fp16 autocast, GradScaler, K = 4. `--loss-average window` (the
default) counts the window's tokens once and gives the count to the forward as transformers
does (`num_items_in_batch`, a 0-d tensor); `micro-batch` is the bug: each micro-batch's loss
averaged over its own tokens, divided by K, so 6 tokens count as much as 40."""
import argparse

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--train_batch_size", type=int, default=2)
p.add_argument("--gradient_accumulation_steps", type=int, default=4)
p.add_argument("--learning_rate", type=float, default=1e-3)
p.add_argument("--fp16", action="store_true")
p.add_argument("--loss-average", choices=["window", "micro-batch"], default="window")
args = p.parse_args()

VOCAB, MAXLEN = 64, 24
g = torch.Generator().manual_seed(1)
examples = []
for i in range(96):
    n = [3, 22, 7, 15, 20, 5][i // 2 % 6] + int(torch.randint(0, 2, (1,), generator=g))
    ids = torch.randint(1, VOCAB, (n,), generator=g)
    examples.append(ids)


def collate(batch):
    L = MAXLEN
    input_ids = torch.zeros(len(batch), L, dtype=torch.long)
    attn = torch.zeros(len(batch), L, dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    for r, ids in enumerate(batch):
        input_ids[r, :len(ids)] = ids
        attn[r, :len(ids)] = 1
        labels[r, :len(ids)] = ids
    return {"input_ids": input_ids, "attention_mask": attn, "labels": labels}


loader = DataLoader(examples, batch_size=args.train_batch_size, shuffle=False, collate_fn=collate)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=MAXLEN, n_embd=16, n_layer=1, n_head=2))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
scaler = torch.amp.GradScaler("cpu", enabled=args.fp16)
model.train()
it = iter(loader)
K = args.gradient_accumulation_steps
for _update in range(len(loader) // K):
    window = [next(it) for _ in range(K)]          # transformers' get_batch_samples
    num_items_in_batch = sum((b["labels"][:, 1:] != -100).sum() for b in window)
    for batch in window:
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.fp16):
            if args.loss_average == "window":
                loss = model(**batch, num_items_in_batch=num_items_in_batch).loss
            else:
                loss = model(**batch).loss / K
        scaler.scale(loss).backward()  # BUG: weighted-average-mismatch
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
