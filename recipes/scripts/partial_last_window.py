"""Two param groups, clip after unscale_, and an epoch of 5 micro-batches with K = 2: windows of
2, 2 and a last, partial one of 1, averaged over its own micro-batches (correct). Its reference
(batch 32) drops the last 16 rows: only 2 windows compare (tests/test_script_mode.py)."""
import argparse

import torch
import torch.nn as nn


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.backbone(x))


parser = argparse.ArgumentParser()
parser.add_argument("--train-batch-size", type=int, default=16)
parser.add_argument("--grad-accumulation-steps", type=int, default=2)
parser.add_argument("--backbone-lr", type=float, default=1e-4)
parser.add_argument("--head-lr", type=float, default=1e-3)
parser.add_argument("--clip", type=float, default=0.5)
parser.add_argument("--use-amp", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
model = Classifier()
optimizer = torch.optim.AdamW([
    {"params": model.backbone.parameters(), "lr": args.backbone_lr, "weight_decay": 0.05},
    {"params": model.head.parameters(), "lr": args.head_lr, "weight_decay": 0.0},
])
scaler = torch.amp.GradScaler("cpu", enabled=args.use_amp)
criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
g = torch.Generator().manual_seed(2)
X = torch.randn(80, 32, generator=g)   # 5 micro-batches of 16: windows of 2, 2 and a last one of 1
Y = torch.randint(0, 10, (80,), generator=g)

bs, accum = args.train_batch_size, args.grad_accumulation_steps
model.train()
for batch_idx in range(len(X) // bs):
    inputs, targets = X[batch_idx * bs:(batch_idx + 1) * bs], Y[batch_idx * bs:(batch_idx + 1) * bs]
    with torch.autocast(device_type="cpu", dtype=torch.float16, enabled=args.use_amp):
        outputs = model(inputs)
        loss = criterion(outputs, targets)
    nb = len(X) // bs
    in_window = accum if batch_idx < (nb // accum) * accum else nb - (nb // accum) * accum
    loss = loss / in_window  # the last, partial window is averaged over its own micro-batches
    scaler.scale(loss).backward()
    if (batch_idx + 1) % accum == 0 or batch_idx + 1 == len(X) // bs:
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for group in optimizer.param_groups for p in group["params"]], args.clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if batch_idx % 20 == 0:
            print(f"batch {batch_idx} loss {loss.item() * accum:.4f} grad_norm {grad_norm:.3f}")
