"""HF Trainer entry point: `python finetune_hf.py`."""

from transformers import Trainer, TrainingArguments

from common import build_model, toy_dataset


def main() -> None:
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, fp16=True)  # MARK-TRAINER-FP16
    Trainer(model=build_model(), args=args, train_dataset=toy_dataset()).train()


if __name__ == "__main__":
    main()
