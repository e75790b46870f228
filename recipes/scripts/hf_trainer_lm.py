"""A language-model fine-tuning script as the transformers examples write them: an
`HfArgumentParser` over `TrainingArguments`, `Trainer.train()`, then `trainer.save_model()`
(safetensors, written from Rust into the output folder the Trainer made).

`--mean_loss_per_micro_batch` subclasses the Trainer with the `compute_loss` many projects
wrote before transformers 4.46: a mean over the micro-batch's tokens that ignores
`num_items_in_batch`. The Trainer then no longer divides by the accumulation steps (the model
accepts loss kwargs), so the optimizer gets K times the gradient.

    python hf_trainer_lm.py --output_dir out --per_device_train_batch_size 2 \\
        --gradient_accumulation_steps 4 --max_steps 3 --use_cpu --report_to none [--bf16]
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)


@dataclass
class ScriptArguments:
    n_layer: int = field(default=1)
    n_embd: int = field(default=16)
    mean_loss_per_micro_batch: bool = field(default=False)


class TinyText(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class MeanLossTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        loss = F.cross_entropy(  # BUG: missing-accumulation-average
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return (loss, logits) if return_outputs else loss


def main():
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=script_args.n_embd,
                        n_layer=script_args.n_layer, n_head=2)
    model = GPT2LMHeadModel(config)
    trainer_class = MeanLossTrainer if script_args.mean_loss_per_micro_batch else Trainer
    trainer = trainer_class(model=model, args=training_args, train_dataset=TinyText())
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
