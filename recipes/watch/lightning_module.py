"""A LightningModule trained by a real `lightning.Trainer` and watched by ampdoctor's
`WatchCallback` the documented way (docs/watch.md). `bug` plants one of the classic mistakes;
the lines that carry them are marked `# BUG: <kind>` (tests/test_watch_lightning.py reads them).

Automatic optimization (Lightning accumulates and divides by `accumulate_grad_batches`) unless
the bug is one of manual optimization's, where `training_step` accumulates K micro-batches itself.

`precision="16-mixed"` on the CPU: Lightning's `precision="16-mixed"` flag would turn into bf16
there, so the run passes its own precision plugin, `MixedPrecision("16-mixed", "cpu", scaler)`,
with a CPU `torch.amp.GradScaler` built in `train` (the line a `frequent-skips` finding names):
fp16 autocast and loss scaling, as on a GPU.
"""

import warnings

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from ampdoctor.sentinel.lightning import WatchCallback

MANUAL = ("manual", "step-per-microbatch", "zero-grad-inside-accumulation",
          "missing-accumulation-average", "clip-before-unscale", "manual-clip",
          "manual-clip-gradients")
#: the norm the manual clips clip to
MAX_NORM = 0.05


class Regressor(pl.LightningModule):
    def __init__(self, bug="none", K=4, width=32, dropout=0.1):
        super().__init__()
        self.bug, self.K = bug, K
        self.net = nn.Sequential(nn.Linear(16, width), nn.Dropout(dropout), nn.ReLU(),
                                 nn.Linear(width, 1))
        self.automatic_optimization = bug not in MANUAL

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss)
        if self.bug == "double-average":
            loss = loss / self.trainer.accumulate_grad_batches  # BUG: double-average
        if self.bug == "scheduler-per-microbatch":
            self.lr_schedulers().step()  # BUG: scheduler-per-microbatch
        opt = self.optimizers()
        if self.bug in ("zero-grad-inside-accumulation", "zero-grad-in-training-step"):
            opt.zero_grad()  # BUG: zero-grad-inside-accumulation
        if self.automatic_optimization:
            return loss
        if self.bug != "missing-accumulation-average":
            loss = loss / self.K
        self.manual_backward(loss)  # BUG: step-per-microbatch # BUG: missing-accumulation-average
        if self.bug == "step-per-microbatch" or (batch_idx + 1) % self.K == 0:
            if self.bug == "clip-before-unscale":
                # the gradients are still scaled here: Lightning unscales inside opt.step()
                params = self.parameters()
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)  # BUG: clip-before-unscale
            if self.bug == "manual-clip-gradients":
                # Lightning's manual-optimization docs' clip: scaled too (Lightning issue 18089)
                self.clip_gradients(opt, MAX_NORM, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        return None

    def on_after_backward(self):
        # automatic optimization: Lightning calls this after each micro-batch's backward, before
        # its unscale_ (Lightning's docs say so): the gradients are still scaled
        if self.bug == "clip-in-on-after-backward":
            torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)  # clip on scaled grads

    def on_before_optimizer_step(self, optimizer):
        # Lightning calls this inside opt.step(), after the GradScaler's unscale_: the clip of
        # manual optimization that sees true gradients
        if self.bug == "manual-clip":
            self.clip_gradients(optimizer, gradient_clip_val=MAX_NORM,
                                gradient_clip_algorithm="norm")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loss_fn(module, batch):
    """One micro-batch's loss, for the replay of manual optimization."""
    x, y = batch
    return nn.functional.mse_loss(module.net(x).float(), y)


def train(bug="none", precision="32-true", steps=12, K=4, b=8, watched=True, every=5,
          on_error="warn", out=None, clip=None, logger=False, root=None, devices=1,
          extra=(), **callback):
    torch.manual_seed(0)
    module = Regressor(bug, K)
    data = torch.randn(steps * K * b, 16, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data, data[:, :1] * 0.5), batch_size=b, shuffle=False)
    manual = bug in MANUAL
    options = {"accumulation_steps": K, "loss_fn": loss_fn} if manual else {}
    options.update(callback)
    cb = WatchCallback(every=every, on_error=on_error, out=out, name=f"lightning {bug}",
                       **options) if watched else None
    plugins = []
    if precision == "16-mixed":
        # growth_interval=1: a scale that doubles after every finite step keeps growing into
        # overflow, and every other step is skipped (the default waits 2000 steps)
        interval = 1 if bug == "frequent-skips" else 2000
        scaler = torch.amp.GradScaler("cpu", growth_interval=interval)  # BUG: frequent-skips
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler))
        precision = None
    trainer = pl.Trainer(
        max_steps=steps * (K if manual else 1), accumulate_grad_batches=1 if manual else K,
        precision=precision, plugins=plugins, accelerator="cpu", devices=devices,
        gradient_clip_val=clip,
        strategy="ddp" if devices > 1 else "auto",
        callbacks=([cb] if cb is not None else []) + list(extra), logger=logger,
        default_root_dir=root,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    return module, cb, trainer


def main():
    """Under `torchrun --nproc-per-node 2 lightning_module.py BUG OUT RESULT`: the DDP strategy
    on 2 CPU ranks (each its DistributedSampler shard); every rank writes its callback's record
    and its final weights to RESULT."""
    import json
    import sys
    from pathlib import Path

    bug, out, result = sys.argv[1:4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watched, cb, trainer = train(bug, steps=6, every=2, out=out, devices=2)
        plain, _, _ = train(bug, steps=6, watched=False, devices=2)
    identical = all(torch.equal(a, b) for a, b in zip(watched.state_dict().values(),
                                                      plain.state_dict().values(), strict=True))
    Path(result, f"rank{trainer.global_rank}.json").write_text(
        json.dumps({"identical": identical, "record": cb.record}, default=str))
    # Lightning leaves the process group up after fit: every rank done with its collectives and
    # the trainers (their strategies hold the DDP wrappers) gone before it is destroyed; a
    # wrapper or a gloo group left to the interpreter's exit can abort the process (SIGABRT)
    import gc

    import torch.distributed as dist
    dist.barrier()
    del watched, cb, trainer, plain, _  # `_`: the second run's trainer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
