"""Plain PyTorch entry point: `python train_amp.py`."""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from common import build_model, toy_dataset


def main(accumulation_steps: int = 2) -> None:
    model = build_model().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda")  # MARK-GRADSCALER
    for step, (x, y) in enumerate(DataLoader(toy_dataset(), batch_size=8)):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda()) / accumulation_steps
        scaler.scale(loss).backward()
        if (step + 1) % accumulation_steps == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
