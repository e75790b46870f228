"""Half-open AMP: the loop was written for bf16 (`enabled=use_bf16`, dtype hard-coded) and
fp16 support was added later by creating a GradScaler only. In an fp16 run the forward never
enters autocast (everything computes in fp32) while the scaler scales/unscales/skips as if it
did: fp16 is "on" in name only."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    use_bf16 = run.precision == "bf16"
    use_fp16 = run.precision == "fp16"
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=use_fp16)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=torch.bfloat16, enabled=use_bf16):  # BUG: half-open-amp
            pred = model(x)
            loss = criterion(pred.float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
