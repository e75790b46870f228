"""Lightning Fabric loops written the way Fabric's gradient-accumulation guide writes them:
`fabric.no_backward_sync(model, enabled=is_accumulating)`, `fabric.backward(loss)` (which does
not divide by K: the loop does), `fabric.clip_gradients`, one step per window."""

import torch.nn.functional as F
from lightning.fabric import Fabric

PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def healthy(model, optimizer, micro_batches, run):
    fabric = Fabric(accelerator="cpu", devices=1, precision=PRECISION[run.precision])
    model, optimizer = fabric.setup(model, optimizer)
    model.train()
    for i, (inputs, targets) in enumerate(micro_batches):
        is_accumulating = (i + 1) % run.accumulation_steps != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = F.mse_loss(model(inputs), targets)
            fabric.backward(loss / run.accumulation_steps)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=run.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()


def missing_average(model, optimizer, micro_batches, run):
    fabric = Fabric(accelerator="cpu", devices=1, precision=PRECISION[run.precision])
    model, optimizer = fabric.setup(model, optimizer)
    model.train()
    for i, (inputs, targets) in enumerate(micro_batches):
        is_accumulating = (i + 1) % run.accumulation_steps != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = F.mse_loss(model(inputs), targets)
            fabric.backward(loss)  # BUG: missing-accumulation-average
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
