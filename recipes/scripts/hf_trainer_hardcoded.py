"""An HF Trainer script as tutorials write one: the TrainingArguments written in the script
(`per_device_train_batch_size=4, gradient_accumulation_steps=4, bf16=True`), no options.
ampdoctor's reference runs compile it with `gradient_accumulation_steps=1` and
`per_device_train_batch_size=16`. `python hf_trainer_hardcoded.py mean-loss`: a `compute_loss`
that ignores `num_items_in_batch` (the mean over the micro-batch's own tokens), so the Trainer
no longer divides by K (the Trainer and the data are hf_trainer_lm.py's).
"""

import sys
import tempfile

from hf_trainer_lm import MeanLossTrainer, TinyText
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


def main():
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        learning_rate=1e-3,
        max_steps=6,
        bf16=True,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=100,
    )
    trainer_class = MeanLossTrainer if sys.argv[1:] == ["mean-loss"] else Trainer
    trainer_class(model=model, args=args, train_dataset=TinyText(n=96)).train()


if __name__ == "__main__":
    main()
