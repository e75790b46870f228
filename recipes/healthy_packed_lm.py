"""Healthy: a causal-LM loop on packed text in the Hugging Face style -- the model's logits are
shifted against the labels, the mean token loss is divided by K, `model.zero_grad()` clears the
gradients, and the window is counted from 1."""

import torch
import torch.nn.functional as F


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    model.zero_grad(set_to_none=True)
    for i, batch in enumerate(micro_batches, start=1):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            logits = model(batch["input_ids"])
        shift_logits = logits[:, :-1].float()
        shift_labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)),
                               shift_labels.reshape(-1))
        scaler.scale(loss / K).backward()

        if i % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            model.zero_grad(set_to_none=True)
