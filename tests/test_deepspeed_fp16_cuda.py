"""DeepSpeed's fp16 engines on a GPU (skipped without CUDA, where DeepSpeed refuses fp16: "Type
fp16 is not supported on your device"). DeepSpeed 0.19.8's ZeRO-0 fp16 path hands its optimizer
1/S of the gradient, S its own loss scale (2^initial_scale_power): `FP16_Optimizer.step` divides
by a scale `engine.backward` never applied (upstream PR #8393, open when this was written). With
the loop right (ampdoctor's own `deepspeed:` loop), that is a framework update that is not what
the config asks for: `gradient-mismatch` in the fp16 rung, its numbers the engine's scale, at the
config key that sets it -- not the loss line. The same config at ZeRO-1 scales and unscales the
same loss: clean. Written for a GPU session to run; the decision itself is unit-tested on a CPU
(tests/test_kind_units.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import CONFIGS, RECIPES, run_cli

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install 'ampdoctor[deepspeed]')"),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="DeepSpeed runs fp16 engines only on a GPU: on a CPU it refuses "
                              "fp16 ('Type fp16 is not supported on your device')"),
]

CONFIG = RECIPES / "deepspeed_zero0_fp16.json"


def _diagnose(tmp_path, name):
    result = run_cli("diagnose", CONFIGS / f"{name}.yaml", "--json", "--out", tmp_path / "runs")
    assert result.stdout.strip(), result.stderr[-3000:]
    record = json.loads(result.stdout)
    return result, record, {r["id"]: r for r in record["rungs"]}


def test_zero0_fp16_update_off_by_the_engines_scale_is_named_at_the_config_key(tmp_path):
    import deepspeed
    if deepspeed.__version__ != "0.19.8":
        pytest.skip(f"measured on DeepSpeed 0.19.8 (PR #8393 open), not {deepspeed.__version__}")
    result, record, rungs = _diagnose(tmp_path, "deepspeed_broken_zero0_fp16_engine_scale")
    assert result.returncode == 1, result.stderr[-3000:]
    assert rungs["fp32-accum"]["status"] == "pass"
    assert record["failed_rung"] == "fp16-scaler"
    [finding] = record["findings"]
    assert finding["kind"] == "gradient-mismatch" and finding["severity"] == "error"
    power = json.loads(CONFIG.read_text())["fp16"]["initial_scale_power"]
    evidence = finding["evidence"]
    assert evidence["loss_scale"] == 2.0 ** power
    assert evidence["factor"] == f"1/{2 ** power}"
    assert evidence["measured"] == pytest.approx(2.0 ** -power, rel=0.05)
    assert evidence["config_key"] == "fp16.initial_scale_power"
    line = next(i for i, t in enumerate(CONFIG.read_text().splitlines(), 1)
                if "initial_scale_power" in t)
    assert finding["location"]["file"] == str(CONFIG)
    assert finding["location"]["line"] == line


def test_the_same_config_at_zero1_is_healthy_in_fp16(tmp_path):
    result, record, rungs = _diagnose(tmp_path, "deepspeed_healthy_zero1_fp16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert record["findings"] == []
    assert rungs["fp16-scaler"]["status"] == "pass"
