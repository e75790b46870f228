"""Trainer fp16 done right: the Trainer owns the loss scale, nothing else touches it."""

from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
)


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
        fp16=True,
        max_grad_norm=1.0,
    )
    Trainer(model=model, args=args, train_dataset=data).train()


if __name__ == "__main__":
    main()
