"""What `ampdoctor.WatchCallback` costs an HF Trainer run, at its default sampling.

A GPT-2 built from a config (`--width`, `--layers`, vocabulary 2048, 64 positions; nothing
downloaded) trains with the Trainer for `--steps` optimizer steps of K = 4 micro-batches of 8
padded sequences whose real lengths vary (labels -100 on the padding), AdamW, clipping at 1.0,
in `--precision` (bf16 or fp32 on a CPU), once plainly and once with
`callbacks=[WatchCallback(every=500)]` (the second window and every 500th replayed in fp32), in
turn, `--repeats` times each. It prints the median wall time and the median CPU time of the
process (all threads; steadier than the wall time on a shared machine) of `trainer.train()` for
each, and the overheads.

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


def run(watched: bool, args: argparse.Namespace) -> tuple[float, float, WatchCallback | None]:
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
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        return time.perf_counter() - start, time.process_time() - cpu, callback


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
    plain, watched, plain_cpu, watched_cpu = [], [], [], []
    callback = None
    for _ in range(args.repeats):
        seconds, cpu, _ = run(False, args)
        plain.append(seconds)
        plain_cpu.append(cpu)
        seconds, cpu, callback = run(True, args)
        watched.append(seconds)
        watched_cpu.append(cpu)
    p, w = statistics.median(plain), statistics.median(watched)
    pc, wc = statistics.median(plain_cpu), statistics.median(watched_cpu)
    assert callback is not None and callback.record is not None
    params = sum(t.numel() for t in callback.watch.params) if callback.watch else 0
    print(f"GPT-2 {params / 1e6:.2f} M parameters, {args.steps} steps of K={K} x {B} rows, "
          f"{args.precision}, torch {torch.__version__}")
    print(f"plain   {p:8.2f} s wall {pc:8.2f} s CPU")
    print(f"watched {w:8.2f} s wall {wc:8.2f} s CPU   overhead {100 * (w - p) / p:+.1f} % wall, "
          f"{100 * (wc - pc) / pc:+.1f} % CPU   ({len(callback.watch.checked)} window(s) "
          f"replayed, verdict {callback.record['verdict']})")


if __name__ == "__main__":
    main()
