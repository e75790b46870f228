"""The shape of YOLOv5's train.py loop, written for the tests: the loss multiplied by the batch
size (a sum over samples), K derived from a nominal batch (`accumulate = max(round(nbs / bs),
1)`, no K option), the optimizer stepped when `ni - last_opt_step >= accumulate` with unscale_,
clip (10), step, update and an EMA of the model beside it, weight decay scaled by
`bs * accumulate / nbs`. Its reference is `--batch-size 64` (K = 1): the same summed gradient.

`--bug loss-over-k` divides that summed loss by K as a mean loss would be: the update is 1/K of
the reference's (double-average).
"""
import argparse
import math
from copy import deepcopy

import torch
import torch.nn as nn


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = deepcopy(model).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


class ComputeLoss:
    def __call__(self, p, targets):
        bs = p.shape[0]
        lbox = ((p - targets) ** 2).mean()
        return lbox * bs, lbox.detach()


def train(opt):
    device = "cpu"
    amp = opt.amp
    nbs = 64
    batch_size = opt.batch_size
    accumulate = max(round(nbs / batch_size), 1)
    weight_decay = opt.weight_decay * batch_size * accumulate / nbs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    g = [], [], []
    for v in model.modules():
        if hasattr(v, "bias") and isinstance(v.bias, nn.Parameter):
            g[2].append(v.bias)
        if hasattr(v, "weight") and isinstance(v.weight, nn.Parameter):
            g[0].append(v.weight)
    optimizer = torch.optim.SGD(g[2], lr=opt.lr0, momentum=0.937, nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": weight_decay})
    ema = ModelEMA(model)
    scaler = torch.amp.GradScaler(device, enabled=amp)
    compute_loss = ComputeLoss()
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(512, 3, 8, 8, generator=gen)
    Y = torch.randn(512, 4, generator=gen)
    nb = len(X) // batch_size
    last_opt_step = -1
    optimizer.zero_grad()
    for epoch in range(opt.epochs):
        model.train()
        for i in range(nb):
            imgs, targets = X[i * batch_size:(i + 1) * batch_size], Y[i * batch_size:(i + 1) * batch_size]
            ni = i + nb * epoch
            with torch.autocast(device, dtype=torch.float16, enabled=amp):
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets)
            if opt.bug == "loss-over-k":
                loss = loss / accumulate
            scaler.scale(loss).backward()  # BUG: double-average (with --bug loss-over-k)
            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if ema:
                    ema.update(model)
                last_opt_step = ni


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=16, help="total batch size for all GPUs")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr0", type=float, default=0.001)
    p.add_argument("--weight-decay", type=float, default=0.0005)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--bug", default="none")
    train(p.parse_args())
