"""The textbook fp16 + accumulation loop: one GradScaler owns the loss scale."""

import torch
import torch.nn as nn

from model import build_model


def train(loader, precision: str = "fp16", accumulation_steps: int = 4, max_grad_norm: float = 1.0):
    model = build_model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    use_fp16 = precision == "fp16"
    scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)  # MARK-GRADSCALER
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_fp16):
            loss = nn.functional.cross_entropy(model(x), y) / accumulation_steps
        scaler.scale(loss).backward()
        if (step + 1) % accumulation_steps == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
