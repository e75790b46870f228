"""CUDA paths: run only where a GPU is present (skipped on CPU-only machines and in CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, RECIPES, run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _spec_on_cuda(tmp_path: Path, source: str, train_loop: str | None = None) -> Path:
    text = (CONFIGS / f"{source}.yaml").read_text()
    text = text.replace("device: cpu", "device: cuda").replace("../recipes", str(RECIPES))
    if train_loop:
        text = text.replace(f"train_loop: {source}:train_loop", f"train_loop: {train_loop}")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_healthy_loop_on_cuda(tmp_path):
    result = run_cli("diagnose", _spec_on_cuda(tmp_path, "healthy_adamw_clip_sched"), "--json",
                     "--out", tmp_path / "runs")
    record = result.record
    assert result.returncode == 0, record["findings"]
    assert record["device"].startswith("cuda")
    statuses = {r["id"]: r["status"] for r in record["rungs"]}
    assert statuses["fp16-scaler"] == "pass" and statuses["skips"] == "pass"
    assert record["series"]["scale"]


def test_broken_loop_on_cuda(tmp_path):
    result = run_cli("diagnose", _spec_on_cuda(tmp_path, "broken_clip_before_unscale"), "--json",
                     "--out", tmp_path / "runs")
    finding = result.record["findings"][0]
    assert result.returncode == 1
    assert finding["kind"] == "clip-before-unscale"
    assert 0.9 * 65536 <= finding["evidence"]["measured"] <= 1.1 * 65536


def test_deprecated_cuda_gradscaler_is_observed(tmp_path):
    loop = tmp_path / "legacy_loop.py"
    loop.write_text(
        "import torch\n"
        "import torch.nn as nn\n\n"
        "def train_loop(model, optimizer, micro_batches, run):\n"
        "    scaler = torch.cuda.amp.GradScaler(enabled=run.precision == 'fp16')\n"
        "    K = run.accumulation_steps\n"
        "    for i, (x, y) in enumerate(micro_batches):\n"
        "        with torch.autocast('cuda', dtype=run.autocast_dtype,\n"
        "                            enabled=run.autocast_dtype is not None):\n"
        "            loss = nn.functional.mse_loss(model(x).float(), y) / K\n"
        "        scaler.scale(loss).backward()\n"
        "        if (i + 1) % K == 0:\n"
        "            scaler.unscale_(optimizer)\n"
        "            scaler.step(optimizer)\n"
        "            scaler.update()\n"
        "            optimizer.zero_grad()\n")
    spec = tmp_path / "legacy.yaml"
    spec.write_text(
        "model: common:make_mlp\n"
        "data: common:make_regression_data\n"
        "loss: common:mse_loss\n"
        "train_loop: legacy_loop:train_loop\n"
        "accumulation_steps: 4\n"
        "micro_batch_size: 8\n"
        "device: cuda\n")
    # the loop lives beside the spec (project_root), with a copy of the shared factories
    (tmp_path / "common.py").write_text((RECIPES / "common.py").read_text())
    result = run_cli("diagnose", spec, "--json", "--out", tmp_path / "runs")
    record = result.record
    assert result.returncode == 0, record["findings"]
    statuses = {r["id"]: r["status"] for r in record["rungs"]}
    assert statuses["fp16-scaler"] == "pass"
    assert record["series"]["scale"], "the deprecated torch.cuda.amp.GradScaler was not observed"
