"""An HF Trainer fine-tuning script that hands its precision to DeepSpeed, as the transformers
DeepSpeed guide writes it: `TrainingArguments(bf16=True, deepspeed=<config>)`, the config
passed on the command line.

    python hf_trainer_deepspeed.py --deepspeed hf_trainer_deepspeed_auto.json   # healthy
    python hf_trainer_deepspeed.py --deepspeed hf_trainer_deepspeed_bf16_off.json

BROKEN with `hf_trainer_deepspeed_bf16_off.json`: its `bf16.enabled` is false while the
Trainer asks for bf16, two settings owning one engine's precision (double-scaling):
transformers refuses it when `trainer.train()` starts. `ampdoctor scan` of the script and the
config names it; `ampdoctor diagnose` of the script names it the same way.

BROKEN with `hf_trainer_deepspeed_bf16_unset.json`: its `bf16` section has no `enabled`, so
nobody refuses anything and DeepSpeed leaves bf16 off: the engine trains in fp32 while the
Trainer asks for bf16 (double-scaling, the same two settings).
"""
import argparse
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import default_collate
from transformers import Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", default="hf_trainer_deepspeed_auto.json")
parser.add_argument("--per_device_train_batch_size", type=int, default=8)
parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
parser.add_argument("--local_rank", type=int, default=-1)
cli = parser.parse_args()


class RegressionTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        x, y = inputs
        out = model(x.to(next(model.parameters()).dtype)).float()
        loss = F.mse_loss(out, y)
        return (loss, out) if return_outputs else loss


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
g = torch.Generator().manual_seed(1)
data = torch.randn(256, 16, generator=g)
rows = [(x, x[:1] * 0.3) for x in data]
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(  # the Trainer's precision, handed to DeepSpeed
        output_dir=os.path.join(out, "run"), bf16=True, deepspeed=cli.deepspeed,
        per_device_train_batch_size=cli.per_device_train_batch_size,
        gradient_accumulation_steps=cli.gradient_accumulation_steps, max_steps=6,
        learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=0.0,
        use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, train_sampling_strategy="sequential", seed=0)
    trainer = RegressionTrainer(model=model, args=args, train_dataset=rows,
                                data_collator=default_collate)
    trainer.train()
