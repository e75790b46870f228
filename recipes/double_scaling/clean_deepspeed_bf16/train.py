"""The loop after the move to bf16: the GradScaler stays in the code but is switched off."""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 10))


def train(engine, loader, accumulation_steps: int = 4) -> None:
    scaler = torch.cuda.amp.GradScaler(enabled=False)  # MARK-GRADSCALER
    criterion = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(loader):
        x, y = x.to(engine.device), y.to(engine.device)
        loss = criterion(engine(x), y)
        engine.backward(scaler.scale(loss))
        if (step + 1) % accumulation_steps == 0:
            engine.step()
