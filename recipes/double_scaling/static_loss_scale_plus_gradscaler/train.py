"""Loop migrated from apex with a static loss scale, then given a GradScaler on top."""

import torch
import torch.nn as nn

STATIC_LOSS_SCALE = 128.0  # kept from the apex days


def train(model, optimizer, loader, accumulation_steps: int = 4, max_grad_norm: float = 1.0):
    scaler = torch.amp.GradScaler("cuda")  # MARK-GRADSCALER
    criterion = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(x), y) / accumulation_steps
        scaled = loss * STATIC_LOSS_SCALE  # MARK-STATIC
        scaler.scale(scaled).backward()
        if (step + 1) % accumulation_steps == 0:
            scaler.unscale_(optimizer)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(STATIC_LOSS_SCALE)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
