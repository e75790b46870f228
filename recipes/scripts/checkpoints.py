"""A training script that handles its files as careful scripts do: it clears an old run folder,
makes its output folder, appends to a log, writes its config with pathlib, a metrics JSON per
step, saves its checkpoint the safe way (`torch.save` to a temp name, then `os.replace`), keeps
only the latest checkpoint, copies it as the best one and reads it back. It checks each of
these as it goes (a missing file raises), so under ampdoctor it must behave as it does plainly.

Run as `python checkpoints.py --accum-steps 4 --batch-size 8 --out-dir out`.
"""

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--out-dir", default="out")
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

old_run = os.path.join(args.out_dir, "old_run")
if os.path.isdir(old_run):
    shutil.rmtree(old_run)                     # a fresh start: the last run's leftovers go
assert not os.path.exists(old_run)
os.makedirs(args.out_dir, exist_ok=True)
Path(args.out_dir, "config.txt").write_text(json.dumps(vars(args)))
assert json.loads(Path(args.out_dir, "config.txt").read_text())["lr"] == args.lr

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
data = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
target = data.sum(dim=1, keepdim=True) * 0.1
K, b = args.accum_steps, args.batch_size

log = open(os.path.join(args.out_dir, "log.txt"), "a")  # noqa: SIM115 - open for the whole run
step = 0
for i in range(len(data) // b):
    x, y = data[i * b:(i + 1) * b], target[i * b:(i + 1) * b]
    loss = nn.functional.mse_loss(model(x), y) / K
    loss.backward()
    if (i + 1) % K:
        continue
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    log.write(f"step {step} loss {loss.item() * K:.6f}\n")
    log.flush()
    with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
        json.dump({"step": step, "loss": loss.item() * K}, f)
    ckpt = os.path.join(args.out_dir, f"ckpt-{step}.pt")
    torch.save({"model": model.state_dict(), "step": step}, ckpt + ".tmp")
    os.replace(ckpt + ".tmp", ckpt)
    previous = os.path.join(args.out_dir, f"ckpt-{step - 1}.pt")
    if os.path.exists(previous):
        os.remove(previous)                    # keep only the latest
    shutil.copy(ckpt, os.path.join(args.out_dir, "best.pt"))
    assert torch.load(os.path.join(args.out_dir, "best.pt"))["step"] == step
    assert sorted(p.name for p in Path(args.out_dir).glob("ckpt-*.pt")) == [f"ckpt-{step}.pt"]
    if step == args.steps:
        break
log.close()
with open(os.path.join(args.out_dir, "log.txt")) as f:
    assert f"step {step} loss" in f.read()
