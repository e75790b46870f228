"""The HF Trainer written the way its documentation writes it: a `Trainer` subclass whose
`compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None)` computes the loss,
`TrainingArguments(gradient_accumulation_steps=K, fp16=..., bf16=..., max_grad_norm=...)`,
the loop's optimizer handed in through `optimizers=`. The micro-batches become the rows of an
in-order dataset (`train_sampling_strategy="sequential"`), so the Trainer's batches are the
ones ampdoctor handed the loop."""

import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainingArguments


class RegressionTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(inputs["inputs"])
        loss = F.mse_loss(outputs, inputs["labels"])
        return (loss, outputs) if return_outputs else loss


class WithLoss(nn.Module):
    """A model whose forward computes its loss and accepts the Trainer's loss kwargs, as the
    transformers models do: the Trainer then leaves the division by K to the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs, labels=None, **kwargs):
        outputs = self.model(inputs)
        loss = F.mse_loss(outputs, labels)  # BUG: missing-accumulation-average
        return {"loss": loss, "logits": outputs}


def _rows(micro_batches):
    return [{"inputs": x, "labels": y} for xs, ys in micro_batches for x, y in zip(xs, ys, strict=True)]


def _args(run, output_dir):
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=run.micro_batch_size,
        gradient_accumulation_steps=run.accumulation_steps,
        max_steps=run.optimizer_steps,
        fp16=run.precision == "fp16",
        bf16=run.precision == "bf16",
        max_grad_norm=run.max_grad_norm,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )


def healthy(model, optimizer, micro_batches, run):
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = RegressionTrainer(model=model, args=_args(run, output_dir),
                                    train_dataset=_rows(micro_batches),
                                    optimizers=(optimizer, None))
        trainer.train()


def loss_ignores_num_items(model, optimizer, micro_batches, run):
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(model=WithLoss(model), args=_args(run, output_dir),
                          train_dataset=_rows(micro_batches), optimizers=(optimizer, None))
        trainer.train()


_ = torch  # the recipes' models are plain torch modules
