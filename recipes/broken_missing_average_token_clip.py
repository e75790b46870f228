"""Two mistakes at once, as in a loop ported from one that stepped every batch: each
micro-batch's loss is the mean over *its own* real tokens (so micro-batches with 5 tokens weigh
as much as those with 60), and nobody divides it by K (the step consumes the sum of K such
means). A gradient clip then bites on that K-times-too-large gradient, so after the clip the
update is not K times the reference: only the gradient before the clip shows the factor."""

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
        scaler.scale(loss).backward()  # BUG: missing-accumulation-average

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
