"""Token-level LM loss with padding, written the pre-`num_items_in_batch` transformers way:
each micro-batch's loss is the mean over *its own* real tokens, then divided by K. Micro-
batches with 5 tokens weigh as much as micro-batches with 60, so the accumulated gradient is
not the per-token mean over the optimizer step."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            logits = model(batch["input_ids"])
        logits = logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               batch["labels"].reshape(-1), ignore_index=-100)
        loss = loss / K
        scaler.scale(loss).backward()  # BUG: weighted-average-mismatch

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
