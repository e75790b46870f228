"""Mistakes in what the `hf_trainer` and `lightning` keys name (each a spec in
sample_configs/bad/frameworks/): ampdoctor refuses them with the key and its YAML line (exit 2),
or says the loop took no optimizer step, never an internal error or a nondeterminism verdict."""

import lightning as L
import torch
import torch.nn.functional as F
from transformers import Trainer

from common import make_mlp
from frameworks.entry_points import Regressor


def make_no_trainer(model, args, train_dataset):
    """hf_trainer.factory that forgets its `return`."""
    Trainer(model=model, args=args, train_dataset=train_dataset)


def make_trainer_dict(model, args, train_dataset):
    """hf_trainer.factory returning a dict of settings instead of the Trainer."""
    return {"model": model, "args": args, "train_dataset": train_dataset}


def plain_module():
    """lightning.module returning a plain nn.Module, not a LightningModule."""
    return make_mlp()


class NoOptimizers(L.LightningModule):
    """A LightningModule without configure_optimizers (and no `optimizer` key in the spec)."""

    def __init__(self):
        super().__init__()
        self.net = make_mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)


class SilentRegressor(Regressor):
    """training_step returns None (the loss computed, never returned): Lightning never steps."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        F.mse_loss(self(x), y)


class WiderRegressor(Regressor):
    """A model of another size than the spec's reference (`reference` of the other spec)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 4))
