"""A small vision transformer trained the way image-model scripts train one: stochastic depth
on every residual branch (timm's `drop_path`: `x.new_empty(shape).bernoulli_(keep_prob)`, two
draws per block), attention dropout through `scaled_dot_product_attention`, label smoothing,
AdamW with a warm-up, fp16 autocast with a GradScaler, clip after `unscale_`.

`--bug no-average` drops the division of the loss by the accumulation steps.

Run as `python vit_stochastic_depth.py --batch-size 8 --grad-accum-steps 4`.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    return x * random_tensor / keep_prob


class DropPath(nn.Module):
    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class Attention(nn.Module):
    def __init__(self, dim, heads=4, attn_drop=0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = attn_drop

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v,
                                           dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, dpr):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop_path = DropPath(dpr)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class TinyViT(nn.Module):
    def __init__(self, dim=32, depth=3, n_cls=5, drop_path_rate=0.2):
        super().__init__()
        self.patch = nn.Linear(12, dim)
        self.pos = nn.Parameter(torch.zeros(1, 9, dim))
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.Sequential(*[Block(dim, dpr[i]) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_cls)

    def forward(self, x):
        x = self.blocks(self.patch(x) + self.pos)
        return self.head(self.norm(x).mean(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--grad-accum-steps", type=int, default=4)
    ap.add_argument("--drop-path", type=float, default=0.2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--bug", choices=["none", "no-average"], default="none")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = TinyViT(drop_path_rate=args.drop_path)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps))
    scaler = torch.amp.GradScaler("cpu")
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(384, 9, 12, generator=g)
    targets = torch.randint(0, 5, (384,), generator=g)
    model.train()
    bs, K = args.batch_size, args.grad_accum_steps
    for i in range(len(images) // bs):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = criterion(model(images[i * bs:(i + 1) * bs]), targets[i * bs:(i + 1) * bs])
        if args.bug != "no-average":
            loss = loss / K
        scaler.scale(loss).backward()  # BUG: missing-accumulation-average
        if (i + 1) % K == 0:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
