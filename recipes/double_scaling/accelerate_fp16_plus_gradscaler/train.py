"""Training script launched with `accelerate launch --config_file accelerate_config.yaml`.

The accelerate config sets mixed_precision: fp16, so the Accelerator owns a GradScaler and
`accelerator.backward` scales the loss; the loop's own GradScaler scales it again.
"""

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main(accumulation_steps: int = 4) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=accumulation_steps)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(1024, 64), torch.randn(1024, 1))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scaler = torch.cuda.amp.GradScaler()  # MARK-GRADSCALER

    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(scaler.scale(loss))
            if accelerator.sync_gradients:
                scaler.unscale_(optimizer)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
