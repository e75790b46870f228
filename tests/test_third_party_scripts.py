"""Real open-source training scripts, unmodified (tests/third_party/), diagnosed in script mode
on tiny local data: no false alarm on a healthy configuration, and the verdict says why when
nothing can be compared.

nanoGPT's train.py samples random offsets with `torch.randint` per batch. A reference of batch
K x b draws the same offsets as K micro-batches of b (one generator stream), but only when
nothing else draws in between: its evaluation at iteration 0 draws batches of its own batch
size, so with evaluation on, the reference reads other data and the run is inconclusive; with
`--eval_iters=0` the data lines up and every step is compared.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, run_cli

NANOGPT = ROOT / "tests" / "third_party" / "nanogpt"
SMALL = ["--dataset=tiny", "--device=cpu", "--compile=False", "--log_interval=1",
         "--block_size=32", "--n_layer=2", "--n_head=2", "--n_embd=32", "--dropout=0.0",
         "--max_iters=5"]

pytestmark = pytest.mark.xdist_group("script_mode")


def _nanogpt(tmp_path: Path) -> Path:
    """A copy of nanoGPT (it reads configurator.py and data/ from its working directory) with
    a tiny token file."""
    folder = tmp_path / "nanogpt"
    shutil.copytree(NANOGPT, folder)
    data = folder / "data" / "tiny"
    data.mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, 65, size=20000).astype(np.uint16)
    tokens.tofile(data / "train.bin")
    tokens[:5000].tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65}, f)
    return folder


def test_the_copy_is_byte_for_byte():
    import hashlib
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
               for p in sorted(NANOGPT.glob("*.py"))}
    assert digests == {"configurator.py": "5cc23aca26b4ab3c", "model.py": "7c01703240dbec5d",
                       "train.py": "413bd97b40bb400a"}, digests


def _diagnose(tmp_path: Path, eval_iters: int, *options: str):
    """nanoGPT at K = 4 micro-batches of 2, its reference one batch of 8."""
    folder = _nanogpt(tmp_path)
    args = [*SMALL, f"--eval_iters={eval_iters}"]
    return run_cli("diagnose", folder / "train.py", "--json", "--out", tmp_path / "runs",
                   *options, "--reference-args",
                   " ".join([*args, "--batch_size=8", "--gradient_accumulation_steps=1"]),
                   "--", *args, "--batch_size=2", "--gradient_accumulation_steps=4",
                   cwd=folder)


def test_nanogpt_healthy_is_compared_step_by_step(tmp_path):
    result = _diagnose(tmp_path, 0)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert record["accumulation_steps"] == 4 and record["micro_batch_size"] == 2
    fp32 = next(r for r in record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["status"] == "pass" and fp32["details"]["steps_compared"] == 3
    assert fp32["details"]["max_relative_error"] < 1e-5
    # on a CPU nanoGPT trains in fp32 (its autocast is a nullcontext there): said, not judged
    skipped = {r["id"]: r["summary"] for r in record["rungs"] if r["status"] == "skip"}
    assert "never enters autocast on cpu" in skipped["bf16-no-scaler"]


def test_nanogpt_with_its_evaluation_is_inconclusive_not_healthy(tmp_path):
    result = _diagnose(tmp_path, 1, "--rungs", "reproducibility,fp32-accum")
    assert result.returncode == 2, result.stderr
    record = result.record
    assert record["verdict"] == "inconclusive" and record["findings"] == []
    assert "contents differ" in record["inconclusive"]
