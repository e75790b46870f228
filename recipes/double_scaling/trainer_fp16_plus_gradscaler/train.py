"""Fine-tune with the HF Trainer, with a custom training_step that kept a hand-made GradScaler.

TrainingArguments(fp16=True) already makes the Trainer scale the loss (through accelerate's
GradScaler); the subclass scales it a second time.
"""

import torch
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
)


class ScaledTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_scaler = torch.amp.GradScaler("cuda")  # MARK-GRADSCALER

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        loss = loss / self.args.gradient_accumulation_steps
        self.loss_scaler.scale(loss).backward()
        return loss.detach()


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained("distilbert-base-uncased")
    model = AutoModelForSequenceClassification.from_pretrained("distilbert-base-uncased", num_labels=2)
    data = load_dataset("imdb", split="train[:1%]").map(
        lambda b: tokenizer(b["text"], truncation=True, padding="max_length"), batched=True
    )
    args = TrainingArguments(  # MARK-TRAINER-FP16
        output_dir="out",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,
        learning_rate=2e-5,
        num_train_epochs=1,
        fp16=True,
        max_grad_norm=1.0,
    )
    ScaledTrainer(model=model, args=args, train_dataset=data).train()


if __name__ == "__main__":
    main()
