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


#: What transformers 5.25 + accelerate 1.16 + DeepSpeed 0.19.8 did with each TrainingArguments
#: precision and DeepSpeed config section, run for real on this CPU (a Trainer over a tiny MLP,
#: ZeRO-0): "ok" trained (or stopped only at DeepSpeed's "fp16 is not supported on your device",
#: the device, not the disagreement), "accelerate"/"transformers" raised their mismatch error
#: (at Trainer() / at train()), "runs-fp32" trained an fp32 engine under a Trainer asking for half
#: precision. The scan's verdict must be the same table.
MEASURED = {
    "fp32": {"fp16 true": "transformers", "bf16 true": "transformers"},
    "bf16": {"fp16 true": "accelerate", "bf16 false": "transformers", "bf16 unset": "runs-fp32"},
    "fp16": {"bf16 true": "accelerate", "fp16 false": "transformers", "fp16 unset": "runs-fp32"},
}
SECTIONS = {
    "none": {}, "fp16 auto": {"fp16": {"enabled": "auto"}},
    "bf16 auto": {"bf16": {"enabled": "auto"}}, "fp16 true": {"fp16": {"enabled": True}},
    "fp16 false": {"fp16": {"enabled": False}}, "bf16 true": {"bf16": {"enabled": True}},
    "bf16 false": {"bf16": {"enabled": False}}, "fp16 unset": {"fp16": {"loss_scale": 0}},
    "bf16 unset": {"bf16": {}},
}
OUTCOMES = {"transformers": "refused-by-transformers", "accelerate": "refused-by-accelerate",
            "runs-fp32": "runs-fp32"}


@pytest.mark.parametrize("trainer", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_measured_combination_is_named_as_the_packages_behave(tmp_path, trainer, section):
    """Each (TrainingArguments precision, config section) pair: double-scaling with the outcome
    the real packages gave and the config key that decides it, or clean where they trained."""
    flag = "" if trainer == "fp32" else f"{trainer}=True, "
    (tmp_path / "train.py").write_text(
        "from transformers import TrainingArguments\n"
        f"args = TrainingArguments('out', {flag}deepspeed='ds_config.json')\n")
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0},
              **SECTIONS[section]}
    (tmp_path / "ds_config.json").write_text(json.dumps(config, indent=1))
    result = run_cli("scan", str(tmp_path), "--json")
    expected = MEASURED[trainer].get(section)
    findings = result.record["findings"]
    if expected is None:
        assert result.returncode == 0 and findings == [], result.stdout
        return
    assert result.returncode == 1, result.stdout
    [finding] = findings
    assert finding["kind"] == "double-scaling" and finding["severity"] == "error"
    assert finding["location"]["line"] == 2
    evidence = finding["evidence"]
    assert evidence["outcome"] == OUTCOMES[expected]
    assert (evidence["measured"], evidence["expected"]) == (2, 1)
    assert evidence["trainer_precision"] == trainer
    name = section.split()[0]
    key = name if expected == "runs-fp32" else f"{name}.enabled"
    assert evidence["config_key"] == key
    text = (tmp_path / "ds_config.json").read_text().splitlines()
    config_owner = evidence["owners"][1]
    assert config_owner["key_path"] == key
    section_line = next(i for i, line in enumerate(text, 1) if f'"{name}"' in line)
    assert config_owner["line"] == section_line + (key != name)   # `enabled`: the next line


def test_alternative_configs_one_of_which_agrees_are_not_a_disagreement(tmp_path):
    """`deepspeed=args.deepspeed` with a bf16 and an fp16 config beside it: the command line
    chooses one, and the bf16 one agrees with the Trainer; with only the fp16 one, accelerate
    would refuse every launch."""
    (tmp_path / "train.py").write_text(
        "from transformers import TrainingArguments\n"
        "def main(args):\n"
        "    return TrainingArguments('out', bf16=True, deepspeed=args.deepspeed)\n")
    (tmp_path / "ds_bf16.json").write_text(json.dumps({"bf16": {"enabled": True}}))
    (tmp_path / "ds_fp16.json").write_text(json.dumps({"fp16": {"enabled": True}}))
    assert run_cli("scan", str(tmp_path), "--json").record["findings"] == []
    (tmp_path / "ds_bf16.json").unlink()
    [finding] = run_cli("scan", str(tmp_path), "--json").record["findings"]
    assert finding["evidence"]["outcome"] == "refused-by-accelerate"


def test_a_precision_decided_at_run_time_is_not_judged(tmp_path):
    """`fp16=args.fp16` beside a config that pins bf16: trained without --fp16 the two agree
    (the Trainer fills nothing, the engine runs bf16); the scan cannot know the value and says
    nothing of the pair (a literal fp16=True there is accelerate's refusal)."""
    (tmp_path / "ds_bf16.json").write_text(json.dumps({"bf16": {"enabled": True}}))
    train = tmp_path / "train.py"
    train.write_text("from transformers import TrainingArguments\n"
                     "def main(args):\n"
                     "    return TrainingArguments('out', fp16=args.fp16, "
                     "deepspeed='ds_bf16.json')\n")
    assert run_cli("scan", str(tmp_path), "--json").record["findings"] == []
    train.write_text(train.read_text().replace("fp16=args.fp16", "fp16=True"))
    [finding] = run_cli("scan", str(tmp_path), "--json").record["findings"]
    assert finding["kind"] == "double-scaling"
    assert finding["evidence"]["outcome"] == "refused-by-accelerate"
