"""A plain training loop watched by `ampdoctor.watch` the documented way (docs/watch.md): the
PyTorch AMP recipe with gradient accumulation, a warm-up scheduler stepped once per optimizer
step, clipping after `unscale_`. `bug` plants one of the classic mistakes; the lines that carry
them are marked `# BUG: <kind>` (tests/test_watch.py reads them).
"""

import contextlib

import torch
import torch.nn as nn

import ampdoctor

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def train(bug="none", precision="fp32", steps=12, K=4, b=8, watched=True, every=5,
          dropout=0.1, on_error="warn", out=None, width=32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.Dropout(dropout), nn.ReLU(),
                          nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    growth = {"growth_factor": 16.0, "growth_interval": 1} if bug == "frequent-skips" else {}
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", **growth)  # BUG: frequent-skips
    dtype = DTYPES.get(precision)
    data = torch.randn(steps * K * b, 16, generator=torch.Generator().manual_seed(1))
    target = data[:, :1] * 0.5
    batches = [(data[i:i + b], target[i:i + b]) for i in range(0, len(data), b)]
    criterion = nn.MSELoss()

    def loss_fn(model, batch):          # the loss of one micro-batch, as the loop computes it
        x, y = batch
        return criterion(model(x).float(), y)

    watch = ampdoctor.watch(model, opt, scaler=scaler, scheduler=sched, accumulation_steps=K,
                            loss_fn=loss_fn, every=every, on_error=on_error, out=out,
                            name=f"plain_loop {bug} {precision}") if watched else None
    with watch if watch is not None else contextlib.nullcontext():
        micro_batches = watch.batches(batches) if watch is not None else batches
        for i, (x, y) in enumerate(micro_batches):
            if bug == "zero-grad-inside-accumulation":
                opt.zero_grad()  # BUG: zero-grad-inside-accumulation
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = criterion(model(x).float(), y)
            if bug != "missing-accumulation-average":
                loss = loss / K
            if bug == "double-average":
                loss = loss / K
            scaler.scale(loss).backward()  # BUG: missing-accumulation-average # BUG: double-average
            if bug == "scheduler-per-microbatch":
                sched.step()  # BUG: scheduler-per-microbatch
            if (i + 1) % K == 0:
                if bug == "clip-before-unscale":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # BUG: clip-before-unscale
                scaler.unscale_(opt)
                if bug != "clip-before-unscale":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                if bug != "scheduler-per-microbatch":
                    sched.step()  # BUG: scheduler-steps-on-skip
                opt.zero_grad(set_to_none=True)
    return model, watch
