"""`ampdoctor scan` on HF Trainer code that hands its precision to a DeepSpeed config
(`TrainingArguments(deepspeed=...)`): the Trainer's fp16/bf16 and the config's must agree (or
the config says "auto"); a disagreement is double-scaling at the Trainer's line, with the config
key beside it. Static: neither transformers nor DeepSpeed is imported."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

TRAIN = '''from transformers import Trainer, TrainingArguments


def main(model, data):
    args = TrainingArguments(output_dir="out", {precision}=True, deepspeed="ds_config.json",
                             gradient_accumulation_steps=4)
    Trainer(model=model, args=args, train_dataset=data).train()
'''


def _scan(tmp_path, trainer: str, config: dict):
    (tmp_path / "train.py").write_text(TRAIN.format(precision=trainer))
    (tmp_path / "ds_config.json").write_text(json.dumps(config, indent=1))
    return run_cli("scan", str(tmp_path), "--json")


@pytest.mark.parametrize(("trainer", "config", "enabled", "key"), [
    ("fp16", {"bf16": {"enabled": True}, "fp16": {"enabled": False}}, "bf16", "bf16.enabled"),
    ("bf16", {"fp16": {"enabled": True}}, "fp16", "fp16.enabled"),
])
def test_trainer_and_deepspeed_config_disagreeing_is_double_scaling(tmp_path, trainer, config,
                                                                     enabled, key):
    result = _scan(tmp_path, trainer, config)
    assert result.returncode == 1, result.stdout
    findings = [f for f in result.record["findings"] if f["kind"] == "double-scaling"]
    assert len(findings) == 1
    finding = findings[0]
    assert finding["location"]["file"].endswith("train.py")
    assert finding["location"]["line"] == 5
    assert f"asks for {trainer}" in finding["message"]
    assert f"enables {enabled}" in finding["message"]
    owners = finding["evidence"]["owners"]
    assert {o["kind"] for o in owners} == {f"Trainer {trainer}", f"DeepSpeed {enabled}"}
    assert any(o["key_path"] == key and o["file"].endswith("ds_config.json") for o in owners)


@pytest.mark.parametrize(("trainer", "config"), [
    ("bf16", {"bf16": {"enabled": True}}),
    ("fp16", {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}),
    ("bf16", {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}),
])
def test_trainer_and_deepspeed_config_agreeing_or_auto_is_clean(tmp_path, trainer, config):
    result = _scan(tmp_path, trainer, config)
    assert result.returncode == 0, result.stdout
    assert result.record["findings"] == []
