"""Healthy: branches explicitly on precision. fp16 goes through the GradScaler; fp32 and
bf16 call loss.backward() / optimizer.step() directly (no scaler exists there at all).
Gradients are cleared with model.zero_grad()."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    use_fp16 = run.precision == "fp16"
    use_autocast = run.precision in ("bf16", "fp16")
    amp_dtype = torch.float16 if use_fp16 else torch.bfloat16
    scaler = torch.amp.GradScaler(run.device_type) if use_fp16 else None
    criterion = nn.MSELoss()

    model.train()
    model.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=amp_dtype, enabled=use_autocast):
            out = model(x)
        loss = criterion(out.float(), y)
        loss = loss / K
        if use_fp16:
            scaler.scale(loss).backward()
        else:
            loss.backward()

        if (step + 1) % K == 0:
            if use_fp16:
                scaler.unscale_(optimizer)
                if run.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                if run.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
                optimizer.step()
            model.zero_grad(set_to_none=True)
