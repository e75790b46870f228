"""Healthy: a bf16-only pipeline (an A100/H100 recipe with no fp16 path at all): autocast to
bfloat16 when asked for mixed precision, no GradScaler anywhere. The spec lists
`precisions: [fp32, bf16]`, so the fp16 rungs are skipped rather than run on code that was never
meant for fp16."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    use_amp = run.autocast_dtype is not None
    model.train()
    for step, (x, y) in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=torch.bfloat16, enabled=use_amp):
            loss = F.mse_loss(model(x).float(), y) / K
        loss.backward()
        if (step + 1) % K == 0:
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
