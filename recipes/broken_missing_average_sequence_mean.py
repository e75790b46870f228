"""Two mistakes at once in a token-level loop: each micro-batch's loss is the mean over its
*sequences* of each sequence's own per-token mean (a short sequence's tokens weigh more than a
long one's, where the reference weighs every real token of the step alike), and nobody divides
it by K, so the step consumes the sum of K such losses' gradients. A clip that bites then
rescales the update: after the clip it is not K times the reference, and before it the ratio is
K times a weighting factor. Only the loop's own gradient of each micro-batch shows the sum."""

import torch
import torch.nn.functional as F


def sequence_mean_loss(logits, labels):
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                reduction="none")
    real = (labels != -100).float()
    per_sequence = (per_token * real).sum(1) / real.sum(1).clamp(min=1)
    return per_sequence.mean()


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(micro_batches):
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            logits = model(batch["input_ids"])
        loss = sequence_mean_loss(logits.float(), batch["labels"])
        scaler.scale(loss).backward()  # BUG: missing-accumulation-average

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
