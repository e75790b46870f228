"""Token-level loss meant to be normalised by the window's real-token count (transformers'
`num_items_in_batch`), but the counting loop *assigns* instead of accumulating: `num_tokens`
ends up holding the count of the window's LAST micro-batch only. Each micro-batch's summed loss
is divided by that, so the step's gradient is (window tokens / last micro-batch's tokens) x the
intended per-token mean -- a factor that changes from window to window (1.95, 10.4, 4.5 here)."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    batches = list(micro_batches)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, len(batches), K):
        window = batches[start:start + K]
        num_tokens = 0
        for mb in window:
            num_tokens = (mb["labels"] != IGNORE_INDEX).sum()
        for mb in window:
            with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                logits = model(mb["input_ids"])
            labels = mb["labels"]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
            scaler.scale(loss / num_tokens).backward()  # BUG: reduction-mismatch

        scaler.unscale_(optimizer)
        if run.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
