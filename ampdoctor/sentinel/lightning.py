"""`ampdoctor.watch` for Lightning: a `lightning.pytorch.Callback` that watches a Trainer's run,
`Trainer(callbacks=[WatchCallback()])`, with the plain loop's checks and record (docs/watch.md).

What it reads from the Trainer when training starts: the one optimizer (`trainer.optimizers`),
its scheduler (`trainer.lr_scheduler_configs`), the GradScaler of the precision plugin (16-mixed),
the precision, and K: `trainer.accumulate_grad_batches` in automatic optimization, the
callback's `accumulation_steps` in manual optimization (Lightning refuses to accumulate there).

The micro-batches of a checked window are kept in `on_train_batch_start`, with the random state
the training step will draw its dropout from. The replay of automatic optimization is the
module's own `training_step(batch, batch_idx)`: Lightning divides the loss it returns by
`accumulate_grad_batches` (`ClosureResult.from_training_step_output` in
`lightning/pytorch/loops/optimization/automatic.py`), so that loss is a micro-batch's mean loss.
It is replayed in fp32 with autocast off, `self.log` muted, and `trainer.accumulate_grad_batches`
reading 1, as for an fp32 full batch: a `training_step` that divides by it itself is then
replayed without that division, and its update shows 1/K. A division by a constant of the
module's own is replayed as it is: give `loss_fn` to replay the loss you mean.

This module imports Lightning; `ampdoctor` never imports it by itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.overrides import TorchFunctionMode

from ..core.findings import Finding, Severity
from ..probe.callsite import CallSiteFinder, Site
from . import DEFAULT_EVERY, Watch

#: Lightning's precision -> the precision the check compares in; the others (bf16-true,
#: 16-true, transformer-engine, ...) hold weights the fp32 replay cannot use: cheap checks only
PRECISIONS = {"32-true": "fp32", "32": "fp32", "16-mixed": "fp16", "bf16-mixed": "bf16"}


class _LightningWatch(Watch):
    """The plain sentinel with Lightning's ways of keeping a window and telling a finding."""

    trainer: Any = None
    precision = "fp32"
    framework = "Lightning"        # named in the evidence: the fix in Lightning's terms

    def _on_forward(self, module: Any, args: Any) -> None:
        """The random state is kept in `on_train_batch_start` (a training step may call its
        layers, not the module's forward)."""

    def _say(self, text: str, finding: Finding) -> None:
        rank_zero_warn(text)
        measured = finding.evidence.get("measured")
        value = float(measured) if isinstance(measured, int | float) else 1.0
        for logger in getattr(self.trainer, "loggers", []):
            logger.log_metrics({f"ampdoctor/{finding.kind}": value},
                               step=self.trainer.global_step)


class _LossLine(TorchFunctionMode):
    """During a replayed `training_step`: the line of the user's code that made the last scalar
    that requires grad (the loss it returns, after any division of its own)."""

    def __init__(self, finder: CallSiteFinder) -> None:
        super().__init__()
        self.finder = finder
        self.site: Site | None = None
        self.torch_dir = str(Path(torch.__file__).resolve().parent) + os.sep

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.dim() == 0 and result.requires_grad:
            frame: FrameType | None = sys._getframe(1)
            while frame is not None and \
                    os.path.realpath(frame.f_code.co_filename).startswith(self.torch_dir):
                frame = frame.f_back
            if frame is not None and not self.finder._classify(frame.f_code.co_filename)[0]:
                self.site = Site(os.path.realpath(frame.f_code.co_filename), frame.f_lineno,
                                 frame.f_code.co_name)
        return result


class WatchCallback(Callback):
    """`Trainer(callbacks=[WatchCallback()])`: the sentinel of a Lightning run.

    `every`: optimizer steps between two checks against the fp32 replay (and the second
    window). `on_error`: `"warn"` (a Lightning warning and a metric `ampdoctor/<kind>` to the
    Trainer's loggers), `"stop"` (that, and `trainer.should_stop = True`: Lightning ends the
    fit cleanly after the batch), `"raise"` (the error raises `ampdoctor.WatchError` from the
    optimizer step; `trainer.fit` re-raises it). `out`: a folder the record is saved in when
    training ends. `accumulation_steps`: K in manual optimization (required there).
    `loss_fn(module, batch)`: the micro-batch loss to replay (required for the expensive check
    in manual optimization; in automatic optimization the default is `training_step`).
    """

    def __init__(self, *, every: int = DEFAULT_EVERY, on_error: str = "warn",
                 out: str | Path | None = None, name: str = "watched Lightning run",
                 accumulation_steps: int | None = None,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None):
        if on_error not in ("warn", "stop", "raise"):
            raise ValueError(f"on_error must be 'warn', 'stop' or 'raise', not {on_error!r}")
        if every < 1:
            raise ValueError(f"every must be >= 1, not {every}")
        self.every, self.on_error, self.out, self.name = every, on_error, out, name
        self.accumulation_steps, self.loss_fn = accumulation_steps, loss_fn
        self.watch: _LightningWatch | None = None
        self.record: dict[str, Any] | None = None
        self.findings: list[Finding] = []

    # ------------------------------------------------------------------ start
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ValueError(
                f"ampdoctor's WatchCallback watches a run with one optimizer; "
                f"configure_optimizers gave {len(optimizers)} "
                f"({', '.join(type(o).__name__ for o in optimizers) or 'none'}). "
                "Remove the callback, or watch a plain loop with ampdoctor.watch per optimizer.")
        automatic = bool(pl_module.automatic_optimization)
        configs = trainer.lr_scheduler_configs
        precision = PRECISIONS.get(str(trainer.precision))
        loss_fn = self._replay_loss(automatic)
        notes = []
        if precision is None and loss_fn is not None:
            loss_fn = None
            notes.append(f"precision={trainer.precision!r} keeps weights the fp32 replay cannot "
                         "use: only the cheap checks ran")
        ddp = trainer.world_size > 1 and isinstance(trainer.strategy, DDPStrategy)
        if trainer.world_size > 1 and not ddp and loss_fn is not None:
            loss_fn = None
            notes.append(f"{type(trainer.strategy).__name__} is not DDP: a rank's consumed "
                         "gradient is not compared with the replay, only the cheap checks ran")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value" \
                and loss_fn is not None:
            loss_fn = None
            notes.append("gradient_clip_algorithm='value' clips each element: the update is not "
                         "compared with the fp32 replay, only the cheap checks ran")
        watch = _LightningWatch(
            pl_module, optimizers[0], accumulation_steps=self._accumulation(trainer, automatic),
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            scheduler=configs[0].scheduler if len(configs) == 1 else None, loss_fn=loss_fn,
            every=self.every, on_error="raise" if self.on_error == "raise" else "warn",
            out=self.out, name=self.name)
        watch.trainer, watch.precision = trainer, precision or "fp32"
        watch.notes.extend(notes)
        if ddp:
            watch.group = getattr(trainer.strategy.model, "process_group", None) \
                or torch.distributed.group.WORLD
        watch.__enter__()
        # the LightningOptimizer that manual optimization hands `self.optimizers()` finds
        # zero_grad on its class, not on the optimizer it wraps
        for wrapper in getattr(trainer.strategy, "_lightning_optimizers", []):
            if getattr(wrapper, "_optimizer", None) is optimizers[0]:
                watch._patch_instance(wrapper, "zero_grad",
                                      watch._wrap_zero_grad(wrapper.zero_grad))
        self.watch = watch

    def _accumulation(self, trainer: Any, automatic: bool) -> int:
        K = self.accumulation_steps
        if automatic:
            if K is not None and trainer.accumulate_grad_batches != K:
                raise ValueError(
                    f"WatchCallback(accumulation_steps={K}) but the Trainer accumulates "
                    f"{trainer.accumulate_grad_batches} batches (automatic optimization): "
                    "leave accumulation_steps out, the callback reads the Trainer's")
            return int(trainer.accumulate_grad_batches)
        if K is None:
            raise ValueError(
                "WatchCallback: this LightningModule uses manual optimization, where Lightning "
                "does not accumulate and cannot say K: give WatchCallback(accumulation_steps=K), "
                "the micro-batches your training_step accumulates per optimizer step")
        return int(K)

    def _replay_loss(self, automatic: bool) -> Callable[[torch.nn.Module, Any], Any] | None:
        user = self.loss_fn
        if user is not None:
            return lambda module, item: user(module, item[0])
        return self._training_step_loss if automatic else None

    def _training_step_loss(self, module: Any, item: tuple[Any, int]) -> torch.Tensor:
        """One micro-batch's loss as automatic optimization takes it, replayed (module
        docstring): the user's line that made it becomes the window's line."""
        watch = self.watch
        assert watch is not None
        batch, batch_idx = item
        line = _LossLine(watch.finder)
        with _replaying(module, watch.trainer), line:
            out = module.training_step(batch, batch_idx)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"training_step returned {type(out).__name__}, not a loss")
        if line.site is not None:
            watch.window.backward_site = line.site
        return loss

    # ------------------------------------------------------------------ every batch
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        watch = self.watch
        if watch is None or not watch._checking():
            return
        w = watch.window
        cuda = [p.device for p in watch.params[:1] if p.device.type == "cuda"]
        w.batches.append((batch, batch_idx))
        w.rng.append((torch.get_rng_state(),
                      torch.cuda.get_rng_state(cuda[0]) if cuda else None))
        w.precision = watch.precision

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        watch = self.watch
        if self.on_error == "stop" and watch is not None and \
                any(f.severity == Severity.ERROR for f in watch.findings):
            trainer.should_stop = True

    # ------------------------------------------------------------------ end
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(exception)

    def _close(self, exc: BaseException | None) -> None:
        watch, self.watch = self.watch, None
        if watch is None:
            return
        watch.__exit__(type(exc) if exc is not None else None, exc, None)
        self.record, self.findings = watch.record, list(watch.findings)


@contextmanager
def _replaying(module: Any, trainer: Any) -> Iterator[None]:
    """A replayed training step: `self.log` / `self.log_dict` record nothing, and
    `trainer.accumulate_grad_batches` reads 1 (the fp32 full batch)."""
    saved = trainer.accumulate_grad_batches
    module.__dict__["log"] = module.__dict__["log_dict"] = _mute
    trainer.accumulate_grad_batches = 1
    try:
        yield
    finally:
        trainer.accumulate_grad_batches = saved
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)


def _mute(*args: Any, **kwargs: Any) -> None:
    return None


__all__ = ["WatchCallback"]
