"""An HF Trainer whose TrainingArguments `fp16`/`bf16` and the DeepSpeed config it hands over
(`TrainingArguments(deepspeed=...)`) disagree, end to end with the real transformers, accelerate
and DeepSpeed on CPU: `diagnose` names it with the kind, numbers, Trainer line and config key
that `ampdoctor scan` gives on the same files, whether transformers refuses the run
(`bf16.enabled: false` under `bf16=True`) or it trains an fp32 engine (a `bf16` section without
`enabled`); a config left "auto" is healthy (its bf16 rung judged, fp16 refused by DeepSpeed on
this device a skip). The `hf_trainer` key with `args: {deepspeed: ...}` hands each rung's
Trainer the config with the rung's precision (a config that pins bf16 is healthy at every
rung), and its double-scaling rung names the user's own TrainingArguments against that config,
as scan does. Skipped where DeepSpeed or transformers is not installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import CONFIGS, RECIPES, run_cli

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None
    or importlib.util.find_spec("transformers") is None,
    reason="deepspeed and transformers are needed (pip install 'ampdoctor[deepspeed,hf]')")

SCRIPTS = RECIPES / "scripts"
SCRIPT = SCRIPTS / "hf_trainer_deepspeed.py"


def _line(path, text: str) -> int:
    return next(i for i, t in enumerate(path.read_text().splitlines(), 1) if text in t)


def _diagnose(tmp_path, config: str):
    result = run_cli("diagnose", SCRIPT, "--json", "--out", tmp_path / "runs", "--",
                     "--deepspeed", config, cwd=SCRIPTS)
    assert result.stdout.strip(), result.stderr[-3000:]
    return result, json.loads(result.stdout)


def _judged(finding: dict) -> tuple:
    """What diagnose and scan must agree on: kind, severity, numbers, the Trainer's line, the
    config key, the outcome, and each setting's file, line and key."""
    ev = finding["evidence"]
    return (finding["kind"], finding["severity"], ev["measured"], ev["expected"],
            finding["location"]["line"], ev["config_key"], ev["outcome"],
            tuple((o["kind"], o["file"], o["line"], o["key_path"]) for o in ev["owners"]))


@pytest.mark.parametrize(("config", "key", "outcome"), [
    ("hf_trainer_deepspeed_bf16_off.json", "bf16.enabled", "refused-by-transformers"),
    ("hf_trainer_deepspeed_bf16_unset.json", "bf16", "runs-fp32"),
])
def test_trainer_and_config_disagreeing_is_named_as_scan_names_it(tmp_path, config, key,
                                                                   outcome):
    result, record = _diagnose(tmp_path, config)
    assert result.returncode == 1, result.stderr[-3000:]
    assert record["failed_rung"] == "double-scaling"
    [finding] = record["findings"]
    assert finding["kind"] == "double-scaling" and finding["severity"] == "error"
    assert finding["location"]["line"] == _line(SCRIPT, "args = TrainingArguments(")
    assert finding["evidence"]["config_key"] == key
    assert finding["evidence"]["outcome"] == outcome
    assert finding["evidence"]["trainer_precision"] == "bf16"
    config_owner = finding["evidence"]["owners"][1]
    assert config_owner["file"] == str(SCRIPTS / config)
    assert config_owner["line"] == _line(SCRIPTS / config, '"bf16"')
    scan = run_cli("scan", str(SCRIPT), str(SCRIPTS / config), "--json")
    assert scan.returncode == 1
    [scanned] = json.loads(scan.stdout)["findings"]
    assert _judged(scanned) == _judged(finding)
    rungs = {r["id"]: r for r in record["rungs"]}
    if outcome == "refused-by-transformers":
        # no run reached a step: the other rungs say why, none is the user's loop-error
        assert all(r["status"] == "not-run" and key in r["summary"]
                   for i, r in rungs.items() if i != "double-scaling")
    else:
        # it runs: ampdoctor's own rungs set the engine's precision, and they pass
        assert rungs["fp32-accum"]["status"] == "pass"
        assert rungs["bf16-no-scaler"]["status"] == "pass"


def test_trainer_handing_an_auto_config_is_healthy(tmp_path):
    result, record = _diagnose(tmp_path, "hf_trainer_deepspeed_auto.json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert record["findings"] == []
    rungs = {r["id"]: r for r in record["rungs"]}
    assert rungs["bf16-no-scaler"]["status"] == "pass"       # the engine ran bf16 and matched
    assert rungs["fp16-scaler"]["status"] == "skip"
    assert "DeepSpeed refused the fp16" in rungs["fp16-scaler"]["summary"]
    scan = run_cli("scan", str(SCRIPT), str(SCRIPTS / "hf_trainer_deepspeed_auto.json"))
    assert scan.returncode == 0


def _spec(tmp_path, name: str):
    result = run_cli("diagnose", CONFIGS / "frameworks" / f"{name}.yaml", "--json", "--out",
                     tmp_path / "runs")
    assert result.stdout.strip(), result.stderr[-3000:]
    record = json.loads(result.stdout)
    return result, record, {r["id"]: r for r in record["rungs"]}


def test_a_loop_following_the_run_over_a_config_pinning_bf16_is_healthy(tmp_path):
    """The loop's Trainer asks for run.precision and its config pins bf16: the user's bf16
    training agrees with the config. The rungs ampdoctor forces into fp32 and fp16 are refused
    by transformers/accelerate over the pinned config: skipped with the key to set to "auto",
    never the user's double-scaling; bf16 is compared."""
    result, record, rungs = _spec(tmp_path, "healthy_trainer_loop_deepspeed_bf16_pinned")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [f for f in record["findings"] if f["severity"] == "error"] == []
    assert rungs["fp32-accum"]["status"] == "skip"
    assert "`bf16.enabled`" in rungs["fp32-accum"]["summary"]
    assert rungs["bf16-no-scaler"]["status"] == "pass"
    assert rungs["bf16-no-scaler"]["details"]["steps_compared"] == 3
    assert rungs["fp16-scaler"]["status"] == "skip"
    assert record["verdict"] == "healthy"


def test_hf_trainer_key_with_a_config_pinning_bf16_is_healthy_at_every_rung(tmp_path):
    """Without the rung's precision in the config, transformers would refuse the fp32 rung
    (`bf16.enabled` true against ampdoctor's own bf16=False)."""
    result, record, rungs = _spec(tmp_path, "healthy_hf_trainer_key_deepspeed")
    assert result.returncode == 0, result.stderr[-3000:]
    assert record["findings"] == []
    assert rungs["fp32-accum"]["status"] == "pass"
    assert rungs["bf16-no-scaler"]["status"] == "pass"
    assert rungs["fp16-scaler"]["status"] == "skip"
    assert "DeepSpeed refused the fp16" in rungs["fp16-scaler"]["summary"]


def test_hf_trainer_key_names_the_scripts_trainer_against_its_config_as_scan_does(tmp_path):
    result, record, rungs = _spec(tmp_path, "broken_hf_trainer_key_deepspeed_bf16_off")
    assert result.returncode == 1, result.stderr[-3000:]
    assert record["failed_rung"] == "double-scaling"
    assert rungs["fp32-accum"]["status"] == "pass"   # the rungs' own Trainers ran and matched
    assert rungs["double-scaling"]["summary"].startswith(
        "an HF Trainer and its DeepSpeed config disagree on the precision: Trainer bf16 at ")
    [finding] = record["findings"]
    config = SCRIPTS / "hf_trainer_deepspeed_bf16_off.json"
    assert finding["location"] == {"file": str(SCRIPT),
                                   "line": _line(SCRIPT, "args = TrainingArguments(")}
    assert finding["evidence"]["config_key"] == "bf16.enabled"
    assert finding["evidence"]["owners"][1]["line"] == _line(config, '"bf16"')
    scan = run_cli("scan", str(SCRIPT), str(config), "--json")
    [scanned] = json.loads(scan.stdout)["findings"]
    assert _judged(scanned) == _judged(finding)


def test_a_loop_whose_trainer_transformers_refuses_is_the_disagreement_not_a_loop_error(
        tmp_path):
    """A train_loop building TrainingArguments(bf16=True, deepspeed=<bf16 off>): transformers
    raises in train(); the rung's finding is that double-scaling, as scan names it."""
    result, record, rungs = _spec(tmp_path, "broken_trainer_loop_deepspeed_bf16_off")
    assert result.returncode == 1, result.stderr[-3000:]
    assert record["failed_rung"] == "fp32-accum"
    [finding] = record["findings"]
    assert finding["kind"] == "double-scaling"
    assert finding["evidence"]["outcome"] == "refused-by-transformers"
    loop_file = RECIPES / "frameworks" / "trainer_deepspeed.py"
    assert finding["location"]["line"] == _line(loop_file, "args = TrainingArguments(")
    scan = run_cli("scan", str(loop_file), str(SCRIPTS / "hf_trainer_deepspeed_bf16_off.json"),
                   "--json")
    [scanned] = json.loads(scan.stdout)["findings"]
    assert _judged(scanned) == _judged(finding)


def test_a_parsed_precision_the_scan_cannot_read_is_named_from_the_refusal(tmp_path):
    """HfArgumentParser's `--bf16` with a config that switches bf16 off: the scan cannot read a
    precision given on the command line, so the finding comes from transformers' refusal itself
    (the config key at its line in the config argument, the Trainer at the line that raised);
    exit 1 with that double-scaling, not exit 3 with the raw error."""
    script = SCRIPTS / "hf_trainer_lm.py"
    config = SCRIPTS / "hf_trainer_deepspeed_bf16_off.json"
    result = run_cli("diagnose", script, "--json", "--out", tmp_path / "runs", "--",
                     "--output_dir", "out", "--per_device_train_batch_size", "2",
                     "--gradient_accumulation_steps", "4", "--max_steps", "3", "--use_cpu",
                     "--report_to", "none", "--bf16", "--deepspeed", config.name, cwd=SCRIPTS)
    assert result.returncode == 1, result.stderr[-3000:]
    record = json.loads(result.stdout)
    assert record["failed_rung"] == "double-scaling"
    [finding] = record["findings"]
    assert finding["kind"] == "double-scaling"
    assert finding["location"]["line"] == _line(script, "trainer.train()")
    evidence = finding["evidence"]
    assert (evidence["config_key"], evidence["outcome"], evidence["trainer_precision"]) == (
        "bf16.enabled", "refused-by-transformers", "bf16")
    assert (evidence["owners"][1]["file"], evidence["owners"][1]["line"]) == (
        str(config), _line(config, '"bf16"'))
