"""A train_loop that builds its HF Trainer over a DeepSpeed config pinning bf16 and follows the
run's precision (`bf16=run.precision == "bf16"`), as a user whose training is bf16 writes it for
ampdoctor's rungs."""

import os
import tempfile

from transformers import TrainingArguments

from frameworks.trainer_deepspeed import make_trainer

#: a config that pins bf16 (`bf16.enabled: true`)
BF16_PINNED = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "trainer_deepspeed_bf16.json")


def trainer_following_the_run_over_a_bf16_config(model, optimizer, micro_batches, run):
    """HEALTHY: a train_loop whose TrainingArguments follow `run.precision` over a DeepSpeed
    config that pins bf16: the user trains in bf16 and the two agree. ampdoctor's fp32 rung
    (and its fp16 one) ask the Trainer for another precision than the config pins and
    transformers (accelerate) refuses it: those rungs are skipped with the reason, not blamed on
    the loop; the bf16 rung is compared."""
    rows = [(x[i], y[i]) for x, y in micro_batches for i in range(len(x))]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, bf16=run.precision == "bf16", fp16=run.precision == "fp16",
            deepspeed=BF16_PINNED, per_device_train_batch_size=run.micro_batch_size,
            gradient_accumulation_steps=run.accumulation_steps, max_steps=run.optimizer_steps,
            learning_rate=1e-2, lr_scheduler_type="constant", use_cpu=True, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
            train_sampling_strategy="sequential")
        make_trainer(model, args, rows).train()
