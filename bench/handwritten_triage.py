"""The least a triage of ampdoctor's questions needs, written by hand: no probe, no CLI.

    python bench/handwritten_triage.py SPEC.yaml [--steps N] [--K K] [--bare]

For the spec's model, data and loop: the loop run in fp32 with, at each optimizer step (a
pre-hook), the fp32 reference gradient of the step's window computed twice at the parameters the
step sees (repeatability + the judge) on a second model, compared to the step's gradient; then
the loop run in bf16, fp16 and fp16 again (the skip check), each step's gradient norm kept and
compared to the fp32 run's. Only scalars are kept. The reference is the spec's `loss` (mean of
the window's micro-batch losses) or, without one, the loop itself in fp32 at K = 1 on one batch
holding the window (as ampdoctor does). Prints one JSON line: wall seconds, passes, verdicts.

`--bare`: the bare loop, the denominator of the memory target -- the spec's loop run once in
each precision (fp32, bf16, fp16), one model and optimizer at a time, nothing else kept.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FORWARDS = {"loop": 0, "reference": 0}


def resolve(root: Path, ref: str):
    module, _, name = ref.partition(":")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return getattr(importlib.import_module(module), name)


def cut(data, N: int, K: int, b: int | None):
    if isinstance(data, (tuple, list)) and data and isinstance(data[0], torch.Tensor):
        return [tuple(t[i * b:(i + 1) * b] for t in data) for i in range(N * K)]
    return [dict(m) if isinstance(m, dict) else tuple(m) for m in list(data)[:N * K]]


def merge(mbs):
    if isinstance(mbs[0], dict):
        return {k: torch.cat([m[k] for m in mbs]) for k in mbs[0]}
    return tuple(torch.cat(parts) for parts in zip(*mbs, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec", type=Path)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--K", type=int)
    parser.add_argument("--device")
    parser.add_argument("--bare", action="store_true", help="only the loop, once per precision")
    args = parser.parse_args()
    started = time.perf_counter()
    spec = yaml.safe_load(args.spec.read_text())
    root = (args.spec.parent / spec.get("project_root", ".")).resolve()
    N = args.steps or spec["optimizer_steps"]
    K = args.K or spec["accumulation_steps"]
    device = torch.device(args.device or spec.get("device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        device = torch.device("cpu")
    seed = spec.get("seed", 0)
    make_model = resolve(root, spec["model"])
    loop = resolve(root, spec["train_loop"])
    loss_fn = resolve(root, spec["loss"]) if spec.get("loss") else None
    opt_spec = dict(spec.get("optimizer") or {"name": "SGD", "lr": 0.05})
    opt_cls = getattr(torch.optim, opt_spec.pop("name"))
    torch.manual_seed(seed)
    mbs = cut(resolve(root, spec["data"])(), N, K, spec.get("micro_batch_size"))
    mbs = [tuple(t.to(device) for t in mb) if isinstance(mb, tuple) else
           {k: v.to(device) for k, v in mb.items()} for mb in mbs]
    clip = spec.get("max_grad_norm")

    def settings(precision: str, K_: int, max_norm, steps: int):
        return SimpleNamespace(precision=precision, device=device, device_type=device.type,
                               autocast_dtype=DTYPES[precision], accumulation_steps=K_,
                               max_grad_norm=max_norm, rank=0, world_size=1,
                               micro_batch_size=spec.get("micro_batch_size"),
                               optimizer_steps=steps)

    def build(kind: str = "loop"):
        torch.manual_seed(seed)
        model = make_model().to(device=device, dtype=torch.float32)
        model.register_forward_pre_hook(
            lambda m, a: FORWARDS.__setitem__(kind, FORWARDS[kind] + 1))
        return model

    if args.bare:
        for precision in DTYPES:
            model = build()
            loop(model, opt_cls(model.parameters(), **opt_spec), mbs,
                 settings(precision, K, clip, N))
            del model
        print(json.dumps({"wall_s": time.perf_counter() - started, "forwards": FORWARDS,
                          "peak_cuda_bytes": torch.cuda.max_memory_allocated()
                          if device.type == "cuda" else None}))
        return
    ref_model = build("reference")

    def reference(state, window: int) -> list[torch.Tensor]:
        """The window's fp32 reference gradient at `state`, one tensor per parameter."""
        ref_model.load_state_dict(state)
        ref_model.train()
        batch = mbs[window * K:(window + 1) * K]
        if loss_fn is not None:
            ref_model.zero_grad(set_to_none=True)
            for mb in batch:
                (loss_fn(ref_model, mb) / len(batch)).backward()
            out = [p.grad for p in ref_model.parameters()]
            ref_model.zero_grad(set_to_none=True)
            return out
        got: list = []
        opt = opt_cls(ref_model.parameters(), **opt_spec)
        handle = opt.register_step_pre_hook(lambda o, a, k: got.append(
            [p.grad.clone() for p in ref_model.parameters()]) if not got else None)
        loop(ref_model, opt, [merge(batch)], settings("fp32", 1, math.inf if clip else None, 1))
        handle.remove()
        return got[0]

    def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        num = sum(float(torch.sum((x.float() - y.float()) ** 2)) for x, y in zip(a, b, strict=True))
        den = sum(float(torch.sum(y.float() ** 2)) for y in b)
        return math.sqrt(num / den) if den else math.inf

    results: dict = {"fp32": [], "repeat": [], "norms": {}}

    def run(precision: str, judge: bool) -> list[float]:
        model = build()
        opt = opt_cls(model.parameters(), **opt_spec)
        norms: list[float] = []

        def pre(o, a, k):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.float()) for g in grads])))   # on device: no sync
            if judge:
                window = len(norms) - 1
                one = reference(model.state_dict(), window)
                two = reference(model.state_dict(), window)
                results["repeat"].append(rel(one, two))
                # the loop's update is clipped: compare directions (the clip only scales)
                gn = math.sqrt(sum(float(torch.sum(g.float() ** 2)) for g in grads))
                rn = math.sqrt(sum(float(torch.sum(r ** 2)) for r in one))
                results["fp32"].append(rel([g / gn for g in grads], [r / rn for r in one]))

        opt.register_step_pre_hook(pre)
        loop(model, opt, mbs, settings(precision, K, clip, N))
        return [float(n) for n in norms]

    fp32 = run("fp32", judge=True)
    for precision in ("bf16", "fp16", "fp16"):
        # an fp16 run that skips a step has fewer norms: compare the steps both ran
        results["norms"][precision] = [n / f if f else math.nan
                                       for n, f in zip(run(precision, False), fp32, strict=False)]
    print(json.dumps({"wall_s": time.perf_counter() - started, "forwards": FORWARDS,
                      "results": results,
                      "peak_cuda_bytes": torch.cuda.max_memory_allocated()
                      if device.type == "cuda" else None}))


if __name__ == "__main__":
    main()
