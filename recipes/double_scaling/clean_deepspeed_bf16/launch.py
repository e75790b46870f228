"""Entry point: `deepspeed launch.py`."""

import deepspeed
import torch
from torch.utils.data import DataLoader, TensorDataset

from train import build_model, train


def main() -> None:
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config="ds_config.json")
    data = TensorDataset(torch.randn(512, 128), torch.randint(0, 10, (512,)))
    train(engine, DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
