"""The training loop of transformers' examples/pytorch/language-modeling/run_clm_no_trainer.py
kept as written (accelerate, `accelerator.accumulate(model)`, `outputs.loss`, the scheduler
prepared, `completed_steps` under `sync_gradients`), on a tiny GPT-2 built from a config and
packed blocks of local token ids. --bug: loss-over-k (the loss divided by K again)."""
import argparse
import math

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

parser = argparse.ArgumentParser()
parser.add_argument("--per_device_train_batch_size", type=int, default=4)
parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
parser.add_argument("--num_train_epochs", type=int, default=1)
parser.add_argument("--learning_rate", type=float, default=5e-4)
parser.add_argument("--block_size", type=int, default=16)
parser.add_argument("--mixed_precision", default="no")
parser.add_argument("--bug", default="none")
args = parser.parse_args()

accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                          mixed_precision=args.mixed_precision)
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 64, (60 * args.block_size,), generator=g)
blocks = [{"input_ids": ids[i:i + args.block_size], "labels": ids[i:i + args.block_size]}
          for i in range(0, len(ids), args.block_size)]
train_dataloader = DataLoader(blocks, shuffle=False, collate_fn=default_data_collator,
                              batch_size=args.per_device_train_batch_size)
config = GPT2Config(vocab_size=64, n_positions=args.block_size, n_embd=32, n_layer=1, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
no_decay = ["bias", "layer_norm.weight"]
optimizer_grouped_parameters = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
     "weight_decay": 0.01},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
     "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
lr_scheduler = get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=0,
                             num_training_steps=max_train_steps * accelerator.num_processes)
model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, lr_scheduler)

completed_steps = 0
for epoch in range(args.num_train_epochs):  # noqa: B007
    model.train()
    for step, batch in enumerate(train_dataloader):  # noqa: B007
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            if args.bug == "loss-over-k":
                loss = loss / args.gradient_accumulation_steps
            accelerator.backward(loss)  # BUG: double-average
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
        if completed_steps >= max_train_steps:
            break
