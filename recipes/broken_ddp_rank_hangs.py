"""Broken under DDP: the ranks disagree on the number of optimizer steps.

Each rank stops when *its* shard runs out of "useful" samples (here: a rank-dependent early
exit, as with uneven shards and `for batch in loader` without `drop_last`): rank 1 leaves after
two windows, rank 0 enters the third window's all-reduce and waits for a peer that has gone.
Without a bound this waits for the collective's timeout (30 minutes by default).
"""

import contextlib

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    steps_on_this_rank = run.optimizer_steps - run.rank   # rank-dependent
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.precision == "fp16"))
    model.train()
    for i, (x, y) in enumerate(micro_batches):
        if i // K >= steps_on_this_rank:
            break
        last = (i + 1) % K == 0
        ctx = model.no_sync() if (hasattr(model, "no_sync") and not last) else contextlib.nullcontext()
        with ctx:
            with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                loss = F.mse_loss(model(x).float(), y) / K
            scaler.scale(loss).backward()  # BUG: loop-error
        if last:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
