"""What `ampdoctor.WatchCallback` costs an HF Trainer run, at its default sampling.

A GPT-2 built from a config (`--width`, `--layers`, vocabulary 2048, 64 positions; nothing
downloaded) trains with the Trainer for `--steps` optimizer steps of K = 4 micro-batches of 8
padded sequences whose real lengths vary (labels -100 on the padding), AdamW, clipping at 1.0,
in `--precision` (bf16 or fp32 on a CPU), once plainly and once with
`callbacks=[WatchCallback(every=500)]` (the second window and every 500th replayed in fp32), in
turn, `--repeats` times each. It prints the median wall time of `trainer.train()` for each and
the overhead.

    python bench/bench_watch_hf.py                      # 300 steps, 1 repeat
    python bench/bench_watch_hf.py --steps 600 --repeats 2 --precision fp32

tests/test_watch_hf.py checks that the weights end bit-identical with and without the
callback, so the difference is the callback's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging

from ampdoctor.sentinel.hf import WatchCallback

VOCAB, SEQ, K, B = 2048, 64, 4, 8


def rows(count: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        real = int(torch.randint(8, SEQ + 1, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[real:] = -100
        out.append({"input_ids": ids, "attention_mask": (torch.arange(SEQ) < real).long(),
                    "labels": labels})
    return out


def run(watched: bool, args: argparse.Namespace) -> tuple[float, WatchCallback | None]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=args.width,
                                       n_layer=args.layers, n_head=4, bos_token_id=0,
                                       eos_token_id=0))
    callback = WatchCallback() if watched else None
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model=model, train_dataset=rows(args.steps * K * B),
                          callbacks=[callback] if callback else None,
                          args=TrainingArguments(
                              output_dir=out, per_device_train_batch_size=B,
                              gradient_accumulation_steps=K, max_steps=args.steps,
                              bf16=args.precision == "bf16", use_cpu=True, report_to="none",
                              save_strategy="no", logging_strategy="no", disable_tqdm=True,
                              train_sampling_strategy="sequential", seed=0))
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start, callback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    plain, watched = [], []
    callback = None
    for _ in range(args.repeats):
        plain.append(run(False, args)[0])
        seconds, callback = run(True, args)
        watched.append(seconds)
    p, w = statistics.median(plain), statistics.median(watched)
    assert callback is not None and callback.record is not None
    params = sum(t.numel() for t in callback.watch.params) if callback.watch else 0
    print(f"GPT-2 {params / 1e6:.2f} M parameters, {args.steps} steps of K={K} x {B} rows, "
          f"{args.precision}, torch {torch.__version__}")
    print(f"plain   {p:8.2f} s")
    print(f"watched {w:8.2f} s   overhead {100 * (w - p) / p:+.1f} %   "
          f"({len(callback.watch.checked)} window(s) replayed, verdict "
          f"{callback.record['verdict']})")


if __name__ == "__main__":
    main()
