"""What `ampdoctor.watch` costs a real training run, at its default sampling.

A transformer language model (token embedding, `nn.TransformerEncoder` of `--layers` layers of
width `--width`, a tied output layer; about 3.6 M parameters by default) trains for `--steps`
optimizer steps of K = 4 micro-batches of 8 sequences of 64 tokens, AdamW, a warm-up
schedule, clipping after `unscale_`, in `--precision` (bf16 autocast by default on a CPU), once
plainly and once under `ampdoctor.watch(..., every=500)` (the default: the second window and
every 500th are replayed in fp32), in turn, `--repeats` times each. It prints the median wall
time of each, the overhead as the median of the pairs' ratios in wall time and in this
process's CPU time (steadier than wall time on a shared machine), and what the sentinel holds
during a checked window (the fp32 reference gradient: one copy of the gradients).

    python bench/bench_watch.py                       # 600 steps, 2 repeats
    python bench/bench_watch.py --steps 1000 --repeats 3 --precision fp16

Both runs are identical by construction (tests/test_watch.py checks that the weights end
bit-identical), so the difference is the sentinel's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ampdoctor

VOCAB, SEQ = 2048, 64


class LM(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.zeros(SEQ, width))
        block = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width,
                                           dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(tokens) + self.pos)
        return self.norm(h) @ self.embed.weight.T


def run(watched: bool, args: argparse.Namespace) -> tuple[float, float, dict]:
    torch.manual_seed(0)
    model = LM(args.width, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    scaler = torch.amp.GradScaler("cpu", enabled=args.precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    K, b = 4, 8
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (b, SEQ + 1), generator=gen) for _ in range(64)]
    batches = (data[i % len(data)] for i in range(args.steps * K))
    criterion = nn.CrossEntropyLoss()

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return criterion(m(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten())

    watch = ampdoctor.watch(model, opt, scaler=scaler, scheduler=sched, accumulation_steps=K,
                            loss_fn=loss_fn) if watched else None
    started, cpu = time.perf_counter(), time.process_time()
    with watch if watch is not None else contextlib.nullcontext():
        source = watch.batches(batches) if watch is not None else batches
        for i, batch in enumerate(source):
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = loss_fn(model, batch) / K
            scaler.scale(loss).backward()
            if (i + 1) % K == 0:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad(set_to_none=True)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    info = {"params": sum(p.numel() for p in model.parameters())}
    if watch is not None:
        assert watch.record is not None
        info.update(verdict=watch.record["verdict"], checked=len(watch.checked),
                    findings=[f.kind for f in watch.findings])
    return seconds, cpu, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's intra-op threads (0: its default); 1 is steadier on a "
                             "shared machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    plain, watched, plain_cpu, watched_cpu = [], [], [], []
    info: dict = {}
    for _ in range(args.repeats):      # in turn, so a drift of the machine hits both
        seconds, cpu, _info = run(False, args)
        plain.append(seconds)
        plain_cpu.append(cpu)
        seconds, cpu, info = run(True, args)
        watched.append(seconds)
        watched_cpu.append(cpu)
    p, w = statistics.median(plain), statistics.median(watched)
    params = info["params"]

    def each(values: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in values)

    def pairwise(a: list[float], b: list[float]) -> float:
        return statistics.median(y / x for x, y in zip(a, b, strict=True))

    print(f"model: {params / 1e6:.2f} M parameters; {args.steps} optimizer steps of K = 4 "
          f"micro-batches of 8 x {SEQ} tokens, {args.precision}, {torch.get_num_threads()} "
          "thread(s)")
    print(f"plain:   {p:.2f} s wall (each: {each(plain)}), CPU {each(plain_cpu)} s")
    print(f"watched: {w:.2f} s wall (each: {each(watched)}), CPU {each(watched_cpu)} s; "
          f"verdict {info['verdict']}, {info['checked']} windows checked against fp32, "
          f"findings {info['findings'] or 'none'}")
    print(f"overhead (median of the pairs, target <= 3 %): wall "
          f"{100 * (pairwise(plain, watched) - 1):+.2f} %, CPU time "
          f"{100 * (pairwise(plain_cpu, watched_cpu) - 1):+.2f} %")
    print(f"held during a checked window: the fp32 reference gradient, {params * 4 / 2**20:.1f} "
          f"MiB (one copy of the model's {params / 1e6:.2f} M gradients); between windows: "
          "nothing")


if __name__ == "__main__":
    main()
