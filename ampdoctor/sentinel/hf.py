"""`ampdoctor.watch` inside the HF Trainer: `Trainer(..., callbacks=[WatchCallback()])`.

The callback takes what the Trainer hands every callback event (transformers' `CallbackHandler`
passes `model`, `optimizer` -- accelerate's `AcceleratedOptimizer` around the torch one, whose
`scaler` is accelerate's GradScaler when fp16 runs -- and `lr_scheduler`) and K from
`args.gradient_accumulation_steps`, and watches the run with the plain loop's sentinel
(`Watch`) from `on_train_begin` to `on_train_end`. It keeps the micro-batches the Trainer feeds
in a checked window with a forward pre-hook (the keyword inputs of a training forward with
grad enabled), and replays them with the model's own token loss, weighted the way the Trainer
weighs the full window (`trainer_loss`). Importing this module imports transformers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import Trainer, TrainerCallback
from transformers.utils import logging

from ..core.findings import Finding
from ..probe.callsite import CallSiteFinder, Site, _torch_dir
from . import DEFAULT_EVERY, Watch
from .checks import LossFn
from .frameworks import FrameworkWatch, accelerate_precision
from .replay import ItemLoss

#: the Trainer's own logger: a finding shows where the Trainer's messages show
logger = logging.get_logger("transformers.trainer")

IGNORE_INDEX = -100
#: how closely the token loss recomputed from the logits must equal the model's own loss to
#: take it as the model's loss (fp32 on both sides; float summation order only)
SAME_LOSS_RTOL = 1e-4


class _LossLine(TorchFunctionMode):
    """Around a training step of a checked window: the user's line that made the last scalar
    requiring grad (the loss in the model's forward, or its division in a `compute_loss` or
    `training_step` override), the line a finding names where the backward is the
    Trainer's."""

    def __init__(self, finder: CallSiteFinder) -> None:
        super().__init__()
        self.finder = finder
        self.site: Site | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.dim() == 0 and result.requires_grad:
            frame: Any = sys._getframe(1)
            torch_dir = _torch_dir()
            while frame is not None and \
                    os.path.realpath(frame.f_code.co_filename).startswith(torch_dir):
                frame = frame.f_back     # torch's own frames (F.cross_entropy, overrides)
            # made by the user's code itself, not by a library (the Trainer's own `/ K`)
            if frame is not None and not self.finder._classify(frame.f_code.co_filename)[0]:
                self.site = Site(os.path.realpath(frame.f_code.co_filename), frame.f_lineno,
                                 frame.f_code.co_name)
        return result


def _training_step(watch: Watch, original: Any) -> Any:
    """The Trainer's `training_step` (or its override), run under `_LossLine` in a checked
    window (the line it finds is the one a finding of that window names). An exception out of
    it takes the watch out of torch first: no `on_train_end` follows it."""

    def training_step(*args: Any, **kwargs: Any) -> Any:
        try:
            if not watch._checking():
                return original(*args, **kwargs)
            with _LossLine(watch.finder) as line:
                result = original(*args, **kwargs)
        except BaseException as error:
            if watch._undo:
                watch.__exit__(type(error), error, None)
            raise
        if line.site is not None:
            watch.window.backward_site = line.site
        return result
    return training_step


def trainer_of(frame: Any) -> Trainer | None:
    """The Trainer that called the callback event (the `self` of a frame above it)."""
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


def _counts(labels: torch.Tensor) -> tuple[int, int]:
    """Real label tokens (not IGNORE_INDEX): all of them, and those a causal LM predicts (the
    first position of each row is never a target once the labels are shifted)."""
    return int(labels.ne(IGNORE_INDEX).sum()), int(labels[..., 1:].ne(IGNORE_INDEX).sum())


def trainer_loss(trainer: Trainer | None) -> LossFn:
    """The loss of one micro-batch the way the Trainer weighs a whole window.

    Where the Trainer passes `num_items_in_batch` (the model takes loss kwargs, the labels are
    token ids), the window's loss is the sum of the micro-batches' summed losses over the
    Trainer's count of the window's items: the model is asked for its summed loss
    (`num_items_in_batch=1`) and the count is taken as the Trainer takes it. Otherwise the
    Trainer divides each micro-batch's mean by K, while the full window in one forward
    averages over all its tokens: the reference is the summed token losses over the tokens the
    model averages over. The summed token cross-entropy is recomputed from the logits (shifted
    or not, as the model's own loss turns out to be), so a model that ignores
    `num_items_in_batch` is not copied; a loss that is no cross-entropy of its logits is taken
    as the model gives it (a sum where the Trainer passes the count, else a mean weighing
    micro-batches equally)."""
    summing = trainer is not None and bool(getattr(trainer, "model_accepts_loss_kwargs", False))
    trainer_shifts = bool(getattr(trainer, "_loss_shifts_labels", False))

    def loss_fn(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
        labels = inputs.get("labels")
        token_ids = isinstance(labels, torch.Tensor) and not labels.is_floating_point()
        out = model(**inputs, num_items_in_batch=1) if summing and token_ids \
            else model(**inputs)
        own = out.get("loss") if isinstance(out, dict) else out[0]
        if not isinstance(own, torch.Tensor):
            raise ValueError("the model's forward returned no loss: it got no labels (the "
                             "Trainer takes them out of the inputs for a compute_loss_func or "
                             "label smoothing), or computes none")
        if not isinstance(labels, torch.Tensor) or not token_ids:
            return own
        every, predicted = _counts(labels)
        counted = inputs.get("shift_labels")
        items = int(counted.ne(IGNORE_INDEX).sum()) if isinstance(counted, torch.Tensor) \
            else (predicted if trainer_shifts else every)
        found = _token_loss(out, labels, float(own))
        if found is None:           # not a cross-entropy of the logits: as the model gives it
            return (own, items) if summing else own
        loss_sum, tokens = found
        return ItemLoss(loss_sum, items if summing else tokens, tokens)
    return loss_fn


def _token_loss(out: Any, labels: torch.Tensor, own: float) -> tuple[torch.Tensor, int] | None:
    """The summed token cross-entropy of the output's logits, shifted as a causal LM's or not,
    whichever the model's own loss is (its sum, or its mean over the tokens it predicts), and
    those tokens; None when it is neither."""
    logits = out.get("logits") if isinstance(out, dict) else None
    if not isinstance(logits, torch.Tensor) or logits.dim() != labels.dim() + 1:
        return None
    logits = logits.float()
    vocab = logits.shape[-1]
    shifted = F.cross_entropy(logits[..., :-1, :].reshape(-1, vocab), labels[..., 1:].reshape(-1),
                              ignore_index=IGNORE_INDEX, reduction="sum")
    plain = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    every, predicted = _counts(labels)

    def close(value: float) -> bool:
        return abs(own - value) <= SAME_LOSS_RTOL * max(abs(value), 1e-12)
    for loss_sum, tokens in ((shifted, predicted), (plain, every)):
        total = float(loss_sum)
        if tokens > 0 and (close(total) or close(total / tokens)):
            return loss_sum, tokens
    return None


class WatchCallback(TrainerCallback):
    """`ampdoctor.watch` as a `transformers.TrainerCallback`: `Trainer(...,
    callbacks=[WatchCallback()])` (docs/watch.md). `record` is the run record once training
    ends; `findings` what was found so far."""

    def __init__(self, *, every: int = DEFAULT_EVERY, on_error: str = "warn",
                 out: str | Path | None = None, loss_fn: LossFn | None = None,
                 name: str = "HF Trainer run"):
        if every < 1:
            raise ValueError(f"every must be >= 1, not {every}")
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', not {on_error!r}")
        self.every, self.on_error, self.out, self.name = every, on_error, out, name
        self.loss_fn = loss_fn
        self.watch: FrameworkWatch | None = None
        self.record: dict[str, Any] | None = None

    @property
    def findings(self) -> list[Finding]:
        return list(self.watch.findings) if self.watch is not None else []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()           # a run that raised before its on_train_end
        model, accelerated = kwargs["model"], kwargs["optimizer"]
        optimizer = getattr(accelerated, "optimizer", accelerated)
        scheduler = kwargs.get("lr_scheduler")
        scheduler = getattr(scheduler, "scheduler", scheduler)
        trainer = trainer_of(sys._getframe(1))
        watch = FrameworkWatch(model, optimizer,
                               accumulation_steps=args.gradient_accumulation_steps,
                               scaler=getattr(accelerated, "scaler", None), scheduler=scheduler,
                               loss_fn=self.loss_fn or trainer_loss(trainer), every=self.every,
                               on_error=self.on_error, out=self.out, name=self.name)
        watch.framework = "HF Trainer"
        watch.log = logger.warning
        accelerator = getattr(trainer, "accelerator", None)
        watch.autocast_precision = accelerate_precision(accelerator, model) \
            if accelerator is not None else None
        watch.__enter__()
        self.watch = watch
        handle = model.register_forward_pre_hook(self._keep, with_kwargs=True, prepend=True)
        watch._undo.append(handle.remove)
        if trainer is not None:
            watch._patch_instance(trainer, "training_step",
                                  _training_step(watch, trainer.training_step))
        else:
            watch.notes.append("the Trainer was not found above on_train_begin: the replay "
                               "weighs windows by the tokens the model averages over, not by "
                               "the Trainer's num_items_in_batch count, and findings name the "
                               "backward's line")

    def _keep(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """A training forward of a checked window: its keyword inputs (without the Trainer's
        `num_items_in_batch`) are the micro-batch the replay runs again."""
        watch = self.watch
        if watch is None or watch._replaying or not module.training \
                or not torch.is_grad_enabled() or not watch._checking():
            return
        if args:
            note = ("the model's training forwards take positional inputs: their windows are "
                    "not replayed (only the Trainer's keyword inputs are kept)")
            if note not in watch.notes:
                watch.notes.append(note)
            return
        watch.window.batches.append({k: v for k, v in kwargs.items()
                                     if k != "num_items_in_batch"})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        watch = self.watch
        if watch is None or not watch._undo:     # none, or closed already (a raised finding)
            self.record = watch.record if watch is not None else None
            return
        watch.__exit__(None, None, None)
        self.record = watch.record
        if self.record is not None:
            logger.info(f"ampdoctor watch: {self.record['verdict']}, "
                        f"{self.record['rungs'][0]['summary']}")
