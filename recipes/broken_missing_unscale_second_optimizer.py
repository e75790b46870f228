"""Article section 8, "half an unscale": a new head with its own optimizer was added to a
working AMP loop. The backbone optimizer still goes through the scaler, but the head optimizer
is stepped directly, so in fp16 the head is updated with gradients still multiplied by the
loss scale (and is stepped even when the scaler found an inf)."""

import torch
import torch.nn as nn


def train_loop(model, optimizer, micro_batches, run):
    backbone_opt, head_opt = optimizer
    K = run.accumulation_steps
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    backbone_opt.zero_grad(set_to_none=True)
    head_opt.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        x, y = batch
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            pred = model(x)
            loss = criterion(pred.float(), y) / K
        scaler.scale(loss).backward()

        if (step + 1) % K == 0:
            scaler.unscale_(backbone_opt)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(
                    [p for g in backbone_opt.param_groups for p in g["params"]],
                    run.max_grad_norm)
            scaler.step(backbone_opt)
            head_opt.step()  # BUG: missing-unscale
            scaler.update()
            backbone_opt.zero_grad(set_to_none=True)
            head_opt.zero_grad(set_to_none=True)
