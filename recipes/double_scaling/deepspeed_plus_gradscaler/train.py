"""Training loop kept from the single-GPU version of this project.

It still builds its own GradScaler, while the launcher hands the model to DeepSpeed whose
ds_config.json enables fp16: the loss is scaled by the GradScaler and again by DeepSpeed.
"""

import torch
import torch.nn as nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 10))


def train(engine, loader, accumulation_steps: int = 4, epochs: int = 1) -> None:
    scaler = torch.cuda.amp.GradScaler()  # MARK-GRADSCALER
    criterion = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for step, (x, y) in enumerate(loader):
            x, y = x.to(engine.device), y.to(engine.device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(engine(x), y) / accumulation_steps
            engine.backward(scaler.scale(loss))  # MARK-ENGINE-BACKWARD
            if (step + 1) % accumulation_steps == 0:
                scaler.unscale_(engine.optimizer)
                engine.step()
                scaler.update()
