"""The `hf_trainer` key with a DeepSpeed config (`args: {deepspeed: ds_config.json}`): the
user's Trainer factory, written as transformers' DeepSpeed guide writes a Trainer; DeepSpeed
casts the module to bf16 itself, so `compute_loss` hands the module its inputs in that dtype."""

import torch.nn.functional as F
from torch.utils.data import default_collate
from transformers import Trainer


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
