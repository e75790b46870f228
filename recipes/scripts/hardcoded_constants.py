"""A script with its settings written in it as constants, no options for them (many small
training scripts and bug reports look like this): fp16 autocast with a GradScaler, K = 4
micro-batches of 8, clipping after `unscale_`.

    python hardcoded_constants.py
    ampdoctor diagnose hardcoded_constants.py

No command line runs it with K = 1: ampdoctor's reference runs compile the script with
ACCUM_STEPS = 1 and BATCH_SIZE = 32 (this file is not changed). `--bug no-divide`: the loss is
not divided by K; `--bug clip-before-unscale`: the clip sees the scaled gradients.
"""

import sys

import torch
import torch.nn.functional as F

ACCUM_STEPS = 4
BATCH_SIZE = 8
LEARNING_RATE = 3e-3
MAX_GRAD_NORM = 1.0
STEPS = 6
BUG = sys.argv[sys.argv.index("--bug") + 1] if "--bug" in sys.argv else "none"


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(1)
    data = torch.randn(BATCH_SIZE * ACCUM_STEPS * STEPS, 16, generator=generator)
    target = data[:, :1] - 2 * data[:, 1:2]
    for i, (x, y) in enumerate(zip(data.split(BATCH_SIZE), target.split(BATCH_SIZE),
                                   strict=True)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        if BUG != "no-divide":
            loss = loss / ACCUM_STEPS
        scaler.scale(loss).backward()  # BUG: missing-accumulation-average
        if (i + 1) % ACCUM_STEPS == 0:
            if BUG == "clip-before-unscale":
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)  # BUG: clip-before-unscale
            scaler.unscale_(optimizer)
            if BUG != "clip-before-unscale":
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
