"""What the `hf_trainer` and `lightning` spec keys take: no loop, only the user's Trainer
factory or LightningModule, written the way transformers' and Lightning's docs write them."""

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate
from transformers import Trainer

from common import make_mlp


class RegressionTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        x, y = inputs
        outputs = model(x)
        loss = F.mse_loss(outputs, y)
        return (loss, outputs) if return_outputs else loss


def make_trainer(model, args, train_dataset):
    """hf_trainer.factory: the Trainer builds its own AdamW from args (learning_rate, ...)."""
    return RegressionTrainer(model=model, args=args, train_dataset=train_dataset,
                             data_collator=default_collate)


class SummingTrainer(RegressionTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        x, y = inputs
        outputs = model(x)
        loss = F.mse_loss(outputs, y, reduction="sum")  # BUG: reduction-mismatch
        return (loss, outputs) if return_outputs else loss


def make_summing_trainer(model, args, train_dataset):
    return SummingTrainer(model=model, args=args, train_dataset=train_dataset,
                          data_collator=default_collate)


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_mlp()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ManualRegressor(Regressor):
    """Manual optimization, as Lightning's docs show gradient accumulation there; forgets / K."""

    def __init__(self, accumulation_steps=4):
        super().__init__()
        self.automatic_optimization = False
        self.accumulation_steps = accumulation_steps

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.manual_backward(loss)  # BUG: missing-accumulation-average
        if (batch_idx + 1) % self.accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
