"""A LightningModule with manual optimization that kept the GradScaler of the plain-PyTorch loop."""

import lightning.pytorch as pl
import torch
import torch.nn as nn


class Regressor(pl.LightningModule):
    def __init__(self, accumulation_steps: int = 4):
        super().__init__()
        self.automatic_optimization = False
        self.accumulation_steps = accumulation_steps
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
        self.scaler = torch.amp.GradScaler("cuda")  # MARK-GRADSCALER

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss = nn.functional.mse_loss(self.net(x), y) / self.accumulation_steps
        self.manual_backward(self.scaler.scale(loss))
        if (batch_idx + 1) % self.accumulation_steps == 0:
            self.scaler.step(opt)
            self.scaler.update()
            opt.zero_grad()
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)
