import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from model import Regressor


def main() -> None:
    data = TensorDataset(torch.randn(2048, 32), torch.randn(2048, 1))
    trainer = pl.Trainer(  # MARK-LIGHTNING
        accelerator="gpu",
        devices=1,
        max_epochs=3,
        precision="16-mixed",
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=32, shuffle=True))


if __name__ == "__main__":
    main()
