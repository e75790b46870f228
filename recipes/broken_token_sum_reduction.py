"""A causal-LM loop switched to per-token losses (`reduction="none"`) to log them, then
reduced with `.sum()` instead of `.mean()`: every micro-batch contributes its summed token loss
/ K, so the update is (next-token targets per micro-batch) times too large -- 4 sequences x 9
shifted targets = 36 here."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    token_losses_log = []

    model.train()
    for i, batch in enumerate(micro_batches, start=1):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            logits = model(batch["input_ids"])
        shift_logits = logits[:, :-1].float()
        shift_labels = batch["labels"][:, 1:]
        token_losses = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)),
                                       shift_labels.reshape(-1), reduction="none")
        token_losses_log.append(token_losses.detach().mean().item())
        loss = token_losses.sum() / K
        scaler.scale(loss).backward()  # BUG: reduction-mismatch

        if i % K == 0:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return token_losses_log
