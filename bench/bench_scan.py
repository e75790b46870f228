"""Benchmark `ampdoctor scan` on a synthetic 2,000-file project (is it fast enough for pre-commit?).

    python bench/bench_scan.py [--files 2000] [--repeat 3] [--keep DIR] [--worst-case]

The tree mixes what a real repository holds: packages of model/data code that mention none of
the scan's keywords (read by regex only), training scripts with GradScaler loops, HF Trainer and
accelerate scripts, DeepSpeed / accelerate / Lightning / HF-args configs, unrelated JSON/YAML
(data, CI), shell launchers, and a few files that do not parse. It times `scan_paths` in process
(best of --repeat) and the whole command in a fresh interpreter
(`python -m ampdoctor.scan.command TREE --json`), and checks the expected findings came out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = '''"""Model code {i}: layers and helpers (no AMP here)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from {pkg}.utils_{j} import init_weights


class Block{i}(nn.Module):
    def __init__(self, dim: int = 256, hidden: int = 1024, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        init_weights(self)

    def forward(self, x):
        h = self.up(self.norm(x))
        h = F.gelu(h) * math.sqrt(2.0)
        return x + self.drop(self.down(h))


def make_stack_{i}(depth: int = 4, dim: int = 256):
    return nn.Sequential(*[Block{i}(dim) for _ in range(depth)])
''' + "\n".join(
    f"\n\ndef helper_{{i}}_{k}(x):\n    y = x * {k} + 1\n    return y / (1 + abs(y))"
    for k in range(12)
) + "\n"

UTILS = '''import torch.nn as nn


def init_weights(module):
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
'''

LOOP = '''"""Training script {i}."""

import torch
import torch.nn as nn

from {pkg}.model_{j} import make_stack_{j}


def train(loader, accumulation_steps: int = 4, max_grad_norm: float = 1.0):
    model = make_stack_{j}().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = torch.amp.GradScaler("cuda")
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y) / accumulation_steps
        scaler.scale(loss).backward()
        if (step + 1) % accumulation_steps == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    train([])
'''

HF = '''from transformers import Trainer, TrainingArguments

from {pkg}.model_{j} import make_stack_{j}


def main():
    args = TrainingArguments(output_dir="out_{i}", per_device_train_batch_size=8, bf16=True)
    Trainer(model=make_stack_{j}(), args=args).train()
'''

DS_LAUNCH = '''import deepspeed

from {pkg}.train_{j} import train
from {pkg}.model_{j} import make_stack_{j}

engine, *_ = deepspeed.initialize(model=make_stack_{j}(), config="{cfg}")
train([])
'''

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "zero_optimization": {"stage": 2},
}
DS_BF16 = {"train_batch_size": 32, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
ACCEL = ("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: bf16\n"
         "num_processes: 2\n")
LIGHTNING = "trainer:\n  max_epochs: 3\n  precision: bf16-mixed\nmodel:\n  lr: 0.001\n"
#: files one synthetic package writes (its code, its configs, launcher, CI file, a broken file)
PER_PACKAGE = 168
CI = ("name: ci\non: [push]\njobs:\n  test:\n    runs-on: ubuntu-latest\n    steps:\n"
      "      - run: pytest -q\n")


def build_tree(root: Path, n_files: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"python": 0, "config": 0, "shell": 0, "other_json": 0}
    written = 0
    n_pkgs = max(1, n_files // PER_PACKAGE)
    double_scaled = 0
    for p in range(n_pkgs):
        pkg = f"pkg{p}"
        d = root / "src" / pkg
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
        written += 1
        for j in range(60):
            (d / f"model_{j}.py").write_text(MODEL.format(i=j, j=j, pkg=pkg))
            (d / f"utils_{j}.py").write_text(UTILS)
            written += 2
        for j in range(12):
            (d / f"train_{j}.py").write_text(LOOP.format(i=j, j=j, pkg=pkg))
            written += 1
        for j in range(6):
            (d / f"hf_{j}.py").write_text(HF.format(i=j, j=j, pkg=pkg))
            written += 1
        cfg_dir = root / "configs" / pkg
        cfg_dir.mkdir(parents=True)
        for j in range(6):
            (cfg_dir / f"ds_bf16_{j}.json").write_text(json.dumps(DS_BF16, indent=2))
            (cfg_dir / f"accelerate_{j}.yaml").write_text(ACCEL)
            (cfg_dir / f"lightning_{j}.yaml").write_text(LIGHTNING)
            rows = [rng.random() for _ in range(200)]
            (cfg_dir / f"data_{j}.json").write_text(json.dumps({"rows": rows}))
            written += 4
        (cfg_dir / "ds_fp16.json").write_text(json.dumps(DS_CONFIG, indent=2))
        (d / "launch_ds.py").write_text(
            DS_LAUNCH.format(pkg=pkg, j=0, cfg=f"configs/{pkg}/ds_fp16.json"))
        (root / "scripts").mkdir(exist_ok=True)
        (root / "scripts" / f"run_{pkg}.sh").write_text(
            f"#!/bin/sh\npython -m {pkg}.train_1 \"$@\"\n")
        (root / "ci").mkdir(exist_ok=True)
        (root / "ci" / f"ci_{pkg}.yml").write_text(CI)
        (d / "broken.py").write_text("def broken(:\n    backward\n")
        written += 5
        double_scaled += 1
    # top up to exactly n_files with more model code
    extra = root / "src" / "extra"
    extra.mkdir()
    k = 0
    while written < n_files:
        (extra / f"model_{k}.py").write_text(MODEL.format(i=k, j=0, pkg="pkg0"))
        written += 1
        k += 1
    for path in root.rglob("*"):
        if path.is_file():
            if path.suffix == ".py":
                counts["python"] += 1
            elif path.suffix in (".json", ".yaml", ".yml"):
                counts["config"] += 1
            elif path.suffix == ".sh":
                counts["shell"] += 1
    counts["files"] = sum(1 for p in root.rglob("*") if p.is_file())
    counts["expected_errors"] = double_scaled
    return counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", default=None, help="build the tree here and keep it")
    parser.add_argument("--worst-case", action="store_true",
                        help="parse every Python file (as if each mentioned a scan keyword)")
    args = parser.parse_args()

    from ampdoctor.scan import scan_paths

    if args.worst_case:
        import re

        import ampdoctor.scan.python_ast as python_ast

        python_ast.PY_KEYWORDS = re.compile(rb"import")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp) / "tree"
        root.mkdir(parents=True, exist_ok=False)
        counts = build_tree(root, args.files)
        print(f"tree: {counts['files']} files ({counts['python']} .py, "
              f"{counts['config']} json/yaml, {counts['shell']} .sh) under {root}")

        times = []
        report = None
        for _ in range(args.repeat):
            start = time.perf_counter()
            report = scan_paths([root])
            times.append(time.perf_counter() - start)
        assert report is not None
        errors = [f for f in report.findings if f.severity == "error"]
        print(f"scan_paths (in process): best {min(times):.3f} s, worst {max(times):.3f} s "
              f"over {args.repeat} runs")
        print(f"  {report.files_scanned} files scanned, {len(report.skipped)} skipped, "
              f"{len(report.owners)} owners, {len(errors)} double-scaling errors "
              f"(expected {counts['expected_errors']})")
        if len(errors) != counts["expected_errors"]:
            print("  UNEXPECTED number of findings", file=sys.stderr)
            return 1

        if args.worst_case:
            return 0
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "ampdoctor.scan.command", str(root), "--json"],
            capture_output=True, text=True, env=env, cwd=REPO,
        )
        wall = time.perf_counter() - start
        data = json.loads(proc.stdout)
        print(f"python -m ampdoctor.scan.command TREE --json: {wall:.3f} s wall "
              f"(exit {proc.returncode}, scan itself {data['seconds']:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
