"""The window's token count already normalises the loss (`num_items_in_batch`, as transformers
does), but the older `/ gradient_accumulation_steps` stayed as well: the token-weighted mean is
divided by K once more (K x too small). The micro-batches differ in length and the spec has no
`loss`: ampdoctor must find the loop's token weighting itself and still see the extra 1/K."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_window_tokens(window):
    return sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in window)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    micro_batches = list(micro_batches)
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")

    model.train()
    optimizer.zero_grad(set_to_none=True)
    num_items_in_batch = None
    for step, batch in enumerate(micro_batches):
        if step % K == 0:
            num_items_in_batch = count_window_tokens(micro_batches[step:step + K])
        with torch.autocast(device_type=run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            logits = model(batch["input_ids"])
        logits = logits.float()
        labels = batch["labels"]
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / num_items_in_batch / K
        scaler.scale(loss).backward()  # BUG: double-average

        if (step + 1) % K == 0:
            scaler.unscale_(optimizer)
            if run.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
