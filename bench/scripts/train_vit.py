"""An image-classification training script the way they are usually written (argparse, a
folder of images read by a Dataset, DataLoader worker processes kept alive, a Vision
Transformer from a model library, fp16 autocast with a GradScaler, gradient accumulation), for
`bench/bench_script_cost.py`: the heavy side of script mode's cost.

    python bench/scripts/train_vit.py --data /tmp/vit_images --steps 3 --amp

The images (32x32 RGB PNGs of 10 classes, synthetic, seeded) are written to `--data` on the
first run if the folder does not exist. The model is Hugging Face transformers' ViT with a small
configuration built locally (no download).
"""

import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from transformers import ViTConfig, ViTForImageClassification

CLASSES = 10


def parse_args():
    p = argparse.ArgumentParser(description="train a small ViT on a folder of images")
    p.add_argument("--data", default="/tmp/ampdoctor_vit_images")
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=2)
    return p.parse_args()


def make_images(folder, count):
    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    for i in range(count):
        label = i % CLASSES
        base = rng.integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
        base[:, :, label % 3] = (base[:, :, label % 3] // 2 + 25 * label).astype(np.uint8)
        Image.fromarray(base).save(os.path.join(folder, f"{i:05d}_{label}.png"))


class ImageFolder(Dataset):
    def __init__(self, folder):
        self.files = sorted(f for f in os.listdir(folder) if f.endswith(".png"))
        self.folder = folder
        self.mean = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        name = self.files[i]
        with Image.open(os.path.join(self.folder, name)) as im:
            pixels = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
        x = torch.from_numpy(pixels).permute(2, 0, 1) - self.mean
        return x, int(name.rsplit("_", 1)[1].split(".")[0])


def main():
    args = parse_args()
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    if not os.path.isdir(args.data):
        make_images(args.data, args.images)
    loader = DataLoader(ImageFolder(args.data), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(1), num_workers=args.workers,
                        persistent_workers=args.workers > 0, drop_last=True)
    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=args.dim,
                       num_hidden_layers=args.depth, num_attention_heads=4,
                       intermediate_size=4 * args.dim, num_labels=CLASSES,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler(device, enabled=args.amp)
    criterion = nn.CrossEntropyLoss()
    model.train()
    steps = 0
    first_step = None
    for _epoch in range(args.epochs):
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            with torch.autocast(device, dtype=torch.float16, enabled=args.amp):
                logits = model(pixel_values=x).logits
                loss = criterion(logits, y) / args.accum_steps
            scaler.scale(loss).backward()
            if (i + 1) % args.accum_steps == 0:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
                now = time.perf_counter()
                if first_step is None:
                    first_step = now
                print(f"step {steps} loss {loss.item() * args.accum_steps:.4f} "
                      f"t={now - started:.2f}s", flush=True)
                if args.steps and steps >= args.steps:
                    return
    print("done", flush=True)


if __name__ == "__main__":
    main()
