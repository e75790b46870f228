"""The `hf_trainer` key with a DeepSpeed config (`args: {deepspeed: ds_config.json}`): the
user's Trainer factory, written as transformers' DeepSpeed guide writes a Trainer; DeepSpeed
casts the module to bf16 itself, so `compute_loss` hands the module its inputs in that dtype."""

import os
import tempfile

import torch.nn.functional as F
from torch.utils.data import default_collate
from transformers import Trainer, TrainingArguments


class EngineRegressionTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        x, y = inputs
        outputs = model(x.to(next(model.parameters()).dtype)).float()
        loss = F.mse_loss(outputs, y)
        return (loss, outputs) if return_outputs else loss


def make_trainer(model, args, train_dataset):
    """hf_trainer.factory: the engine's optimizer is the Trainer's AdamW from args."""
    return EngineRegressionTrainer(model=model, args=args, train_dataset=train_dataset,
                                   data_collator=default_collate)


#: a config whose `bf16.enabled` is false (the script recipe's)
BF16_OFF = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "scripts",
                                         "hf_trainer_deepspeed_bf16_off.json"))


def bf16_trainer_over_a_bf16_off_config(model, optimizer, micro_batches, run):
    """BROKEN: a train_loop whose TrainingArguments ask for bf16 and hand DeepSpeed a config
    that switches bf16 off: transformers refuses it when train() starts (double-scaling, the
    finding `ampdoctor scan` gives on this file and the config), not the loop's own error."""
    rows = [(x[i], y[i]) for x, y in micro_batches for i in range(len(x))]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(  # BUG: double-scaling
            output_dir=out, bf16=True, deepspeed=BF16_OFF,
            per_device_train_batch_size=run.micro_batch_size,
            gradient_accumulation_steps=run.accumulation_steps, max_steps=run.optimizer_steps,
            learning_rate=1e-2, lr_scheduler_type="constant", use_cpu=True, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
            train_sampling_strategy="sequential")
        make_trainer(model, args, rows).train()
