"""An HF Trainer run watched by `ampdoctor.sentinel.hf.WatchCallback` the documented way
(`Trainer(..., callbacks=[WatchCallback()])`, docs/watch.md): a tiny GPT-2 built from a config
(nothing downloaded) on padded sequences whose real lengths differ (labels -100 and attention
mask 0 on the padding), K micro-batches per optimizer step. `bug` plants a mistake on the line
marked `# BUG: <kind>` (tests/test_watch_hf.py reads them):

- `double-average`: a `compute_loss` override that takes the Trainer's `num_items_in_batch`
  loss and divides it by K again;
- `zero-grad-inside-accumulation`: a `compute_loss` override that clears the gradients first;
- `scheduler-per-microbatch`: a `training_step` override that steps the scheduler;
- `weighted-average-mismatch`: a model whose forward averages each micro-batch's tokens itself
  and takes no loss kwargs, so the Trainer divides each micro-batch's mean by K (the
  accumulation bug transformers fixed in October 2024);
- `missing-accumulation-average`: the same model taking `**kwargs` but ignoring
  `num_items_in_batch`: the Trainer then leaves the division to the loss, and nobody divides.

- `clip-before-unscale` (fp16 on a GPU): a `training_step` override that clips after the
  backward, on the still scaled gradients.

`bug="z-loss"` is a healthy twin whose loss is no plain cross-entropy (`ZLossLM`).
"""

import contextlib
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ampdoctor.sentinel.hf import WatchCallback

IGNORE, VOCAB, LENGTH = -100, 48, 12


class DoubleAverageTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss / self.args.gradient_accumulation_steps  # BUG: double-average
        return (loss, outputs) if return_outputs else loss


class ZeroGradTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        model.zero_grad()  # BUG: zero-grad-inside-accumulation
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class SchedulerPerMicroBatchTrainer(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.lr_scheduler.step()  # BUG: scheduler-per-microbatch
        return loss


class ClipInStepTrainer(Trainer):
    """Clips in its own training_step, after the backward: in fp16 on a GPU the gradients are
    still scaled there (the Trainer unscales them in its own clip, before the step)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # BUG: clip-before-unscale
        return loss


class MeanLossLM(nn.Module):
    """A causal LM whose loss is its own micro-batch mean; no `**kwargs`, so the Trainer
    cannot hand it `num_items_in_batch`."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE)  # BUG: weighted-average-mismatch # BUG: missing-accumulation-average
        return {"loss": loss, "logits": logits}


class KwargsMeanLossLM(MeanLossLM):
    """Takes the Trainer's loss kwargs (so the Trainer does not divide by K) and ignores
    them."""

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        return super().forward(input_ids, attention_mask, labels)


class ZLossLM(nn.Module):
    """Healthy: a causal LM whose loss adds a z-loss (the squared log-partition of each
    predicted token) to the cross-entropy, summed and divided by the Trainer's
    `num_items_in_batch` (its own token count without it): not a plain cross-entropy of the
    logits, so the watch takes the model's summed loss as it is."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, labels=None, num_items_in_batch=None,
                **kwargs):
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        targets = labels[:, 1:].reshape(-1)
        flat = logits[:, :-1].reshape(-1, VOCAB)
        real = targets != IGNORE
        loss_sum = F.cross_entropy(flat, targets, ignore_index=IGNORE, reduction="sum") \
            + 1e-2 * (torch.logsumexp(flat, -1)[real] ** 2).sum()
        return {"loss": loss_sum / (num_items_in_batch or real.sum()), "logits": logits}


def rows(count, seed=3, ragged=True):
    """`count` sequences; the real length of each run of 4 rows drawn together (so the
    micro-batches of 2 rows differ in tokens), the rest padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    real = LENGTH
    for i in range(count):
        if i % 2 == 0 and ragged:
            real = int(torch.randint(3, LENGTH + 1, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        labels = ids.clone()
        labels[real:] = IGNORE
        out.append({"input_ids": ids, "attention_mask": (torch.arange(LENGTH) < real).long(),
                    "labels": labels})
    return out


def build_model(bug="none"):
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1,
                                    n_head=2, bos_token_id=0, eos_token_id=0))
    wrapper = {"weighted-average-mismatch": MeanLossLM,
               "missing-accumulation-average": KwargsMeanLossLM, "z-loss": ZLossLM}.get(bug)
    return wrapper(lm) if wrapper is not None else lm


def train(bug="none", precision="fp32", steps=4, K=4, b=2, watched=True, every=2,
          on_error="warn", out=None, ragged=True, max_grad_norm=1.0, save_steps=None,
          device="cpu"):
    model = build_model(bug)
    callback = WatchCallback(every=every, on_error=on_error, out=out) if watched else None
    trainer_class = {"double-average": DoubleAverageTrainer,
                     "zero-grad-inside-accumulation": ZeroGradTrainer,
                     "scheduler-per-microbatch": SchedulerPerMicroBatchTrainer,
                     "clip-before-unscale": ClipInStepTrainer}.get(bug, Trainer)
    with tempfile.TemporaryDirectory() as output_dir, contextlib.ExitStack():
        args = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=b, gradient_accumulation_steps=K,
            max_steps=steps, bf16=precision == "bf16", fp16=precision == "fp16",
            learning_rate=1e-3, max_grad_norm=max_grad_norm,
            train_sampling_strategy="sequential", use_cpu=device == "cpu",
            report_to="none", save_strategy="steps" if save_steps else "no",
            save_steps=save_steps or 500, logging_strategy="no", disable_tqdm=True, seed=0)
        trainer = trainer_class(model=model, args=args,
                                train_dataset=rows(steps * K * b, ragged=ragged),
                                callbacks=[callback] if callback is not None else None)
        trainer.train()
    return model, callback
