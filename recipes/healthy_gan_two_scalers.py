"""Healthy: a GAN with one GradScaler per network, as several GAN repositories do. Each scaler
scales only its own network's loss and unscales/steps only that network's optimizer; the
parameters are disjoint (`fake.detach()` for D's loss, D frozen while G's loss runs backward),
so the two scalers are two separate loss-scale state machines, not two on one loss.

    scaler_D: scale(loss_D) -> D's gradients -> step(opt_D) -> update()
    scaler_G: scale(loss_G) -> G's gradients -> step(opt_G) -> update()

The spec's `model`, `data` and `optimizer` are the factories below."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.D = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, z):
        return self.G(z)


def make_gan():
    return GAN()


def make_optimizers(model):
    return [torch.optim.Adam(model.G.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(model.D.parameters(), lr=2e-4, betas=(0.5, 0.999))]


def make_data():
    g = torch.Generator().manual_seed(9)
    return torch.randn(96, 8, generator=g), torch.randn(96, 16, generator=g) * 0.5 + 1.0


def train_loop(model, optimizers, micro_batches, run):
    opt_G, opt_D = optimizers
    K = run.accumulation_steps
    fp16 = run.precision == "fp16"
    scaler_G = torch.amp.GradScaler(run.device_type, enabled=fp16)
    scaler_D = torch.amp.GradScaler(run.device_type, enabled=fp16)
    autocast = dict(device_type=run.device_type, dtype=run.autocast_dtype,
                    enabled=run.autocast_dtype is not None)
    for i, (z, real) in enumerate(micro_batches):
        with torch.autocast(**autocast):
            fake = model(z)
            d_real = model.D(real).float()
            d_fake = model.D(fake.detach()).float()
            loss_D = (F.softplus(-d_real).mean() + F.softplus(d_fake).mean()) / K
        scaler_D.scale(loss_D).backward()
        for p in model.D.parameters():
            p.requires_grad_(False)
        with torch.autocast(**autocast):
            loss_G = F.softplus(-model.D(fake).float()).mean() / K
        scaler_G.scale(loss_G).backward()
        for p in model.D.parameters():
            p.requires_grad_(True)
        if (i + 1) % K == 0:
            scaler_D.step(opt_D)
            scaler_D.update()
            scaler_G.step(opt_G)
            scaler_G.update()
            opt_D.zero_grad(set_to_none=True)
            opt_G.zero_grad(set_to_none=True)
