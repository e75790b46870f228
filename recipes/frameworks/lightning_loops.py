"""PyTorch Lightning written the way its docs write it: a LightningModule whose
`training_step` returns the loss, and a `Trainer(accumulate_grad_batches=K, precision=...,
gradient_clip_val=...)` (automatic optimization: Lightning divides by K and runs the last
micro-batch inside `optimizer.step(closure)`), or manual optimization with
`self.manual_backward` and a step every K batches."""

import lightning as L
import torch.nn.functional as F
from torch.utils.data import DataLoader

PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


class Regressor(L.LightningModule):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return F.mse_loss(self.model(inputs), targets)

    def configure_optimizers(self):
        return self.optimizer


class ManualRegressor(Regressor):
    def __init__(self, model, optimizer, accumulation_steps, divide=True):
        super().__init__(model, optimizer)
        self.automatic_optimization = False
        self.accumulation_steps = accumulation_steps
        self.divide = divide

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        inputs, targets = batch
        loss = F.mse_loss(self.model(inputs), targets)
        if self.divide:
            loss = loss / self.accumulation_steps
        self.manual_backward(loss)  # BUG: missing-accumulation-average
        if (batch_idx + 1) % self.accumulation_steps == 0:
            self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()


def _trainer(run, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, precision=PRECISION[run.precision],
                     max_steps=run.optimizer_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def healthy(model, optimizer, micro_batches, run):
    trainer = _trainer(run, accumulate_grad_batches=run.accumulation_steps,
                       gradient_clip_val=run.max_grad_norm)
    trainer.fit(Regressor(model, optimizer), DataLoader(list(micro_batches), batch_size=None))


def healthy_manual(model, optimizer, micro_batches, run):
    trainer = _trainer(run)
    module = ManualRegressor(model, optimizer, run.accumulation_steps)
    trainer.fit(module, DataLoader(list(micro_batches), batch_size=None))


def manual_missing_average(model, optimizer, micro_batches, run):
    trainer = _trainer(run)
    module = ManualRegressor(model, optimizer, run.accumulation_steps, divide=False)
    trainer.fit(module, DataLoader(list(micro_batches), batch_size=None))


class ManualScheduled(Regressor):
    """Manual optimization as Lightning's docs write it with an LR scheduler: the loss divided
    by N, `self.manual_backward(loss)`, and under `if (batch_idx + 1) % N == 0:` the clip, the
    step, the zero_grad and `sch.step()`."""

    def __init__(self, model, optimizer, accumulation_steps):
        super().__init__(model, optimizer)
        self.automatic_optimization = False
        self.accumulation_steps = accumulation_steps

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        sch = self.lr_schedulers()
        inputs, targets = batch
        loss = F.mse_loss(self.model(inputs), targets) / self.accumulation_steps
        self.manual_backward(loss)
        if (batch_idx + 1) % self.accumulation_steps == 0:
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sch.step()

    def configure_optimizers(self):
        from torch.optim.lr_scheduler import LambdaLR

        warmup = LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 10))
        return [self.optimizer], [warmup]


def healthy_manual_scheduler(model, optimizer, micro_batches, run):
    trainer = _trainer(run)
    module = ManualScheduled(model, optimizer, run.accumulation_steps)
    trainer.fit(module, DataLoader(list(micro_batches), batch_size=None))
