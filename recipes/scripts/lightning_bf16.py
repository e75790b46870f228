"""A LightningModule as most are written, trained by `Trainer(accumulate_grad_batches=K,
precision="bf16-mixed", gradient_clip_val=1.0)`: its `training_step` calls `self.net(x)`, not
`self(x)` (the module's own forward never runs), and Lightning runs each window's last forward
and backward inside `optimizer.step(closure)`.

Run as `python lightning_bf16.py`; `--bug divide-by-k` divides the loss by K in `training_step`,
on top of Lightning's own division (double-average).
"""
import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class LitModel(L.LightningModule):
    def __init__(self, lr=1e-2, bug="none"):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
        self.lr = lr
        self.bug = bug

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.bug == "divide-by-k":
            loss = loss / self.trainer.accumulate_grad_batches  # BUG: double-average
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--accumulate_grad_batches", type=int, default=4)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--bug", default="none")
    args = p.parse_args()
    L.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = torch.randint(0, 3, (256,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
    trainer = L.Trainer(max_epochs=1, accumulate_grad_batches=args.accumulate_grad_batches,
                        precision=args.precision, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        gradient_clip_val=1.0)
    trainer.fit(LitModel(bug=args.bug), loader)


if __name__ == "__main__":
    main()
