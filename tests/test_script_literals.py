"""Script mode on scripts whose K and micro-batch are written in them, not options
(recipes/scripts/hardcoded_constants.py: module constants; config_dict.py: a dict literal in
`main()`). The reference's runs compile the script with those two literals changed (K to 1, the
micro-batch to K x b); the file is not changed, its line numbers are the same, and the record
names the literals (`reference_literals`). A name written twice is exit 2 naming both lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampdoctor.core.errors import UsageError
from ampdoctor.runner.export_test import render
from ampdoctor.script.infer import infer_reference
from conftest import RECIPES, assert_undivided_loss, marked_line, run_cli

SCRIPTS = RECIPES / "scripts"
CONSTANTS = SCRIPTS / "hardcoded_constants.py"
DICT = SCRIPTS / "config_dict.py"
pytestmark = pytest.mark.xdist_group("script_mode")


def diagnose(tmp_path: Path, script: Path, *args: str):
    return run_cli("diagnose", script, "--json", "--out", tmp_path / "runs", "--steps", "3",
                   "--", *args)


def _line(script: Path, text: str) -> int:
    return next(n for n, line in enumerate(script.read_text().splitlines(), start=1)
                if line.startswith(text))


def test_module_constants_healthy_and_the_file_untouched(tmp_path):
    before = CONSTANTS.read_bytes()
    result = diagnose(tmp_path, CONSTANTS)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert record["reference_args"] == [] and record["reference_args_inferred"] is True
    assert record["reference_literals"] == [
        {"name": "ACCUM_STEPS", "line": _line(CONSTANTS, "ACCUM_STEPS = 4"), "value": 1},
        {"name": "BATCH_SIZE", "line": _line(CONSTANTS, "BATCH_SIZE = 8"), "value": 32}]
    statuses = {r["id"]: r["status"] for r in record["rungs"]}
    assert statuses["fp32-accum"] == statuses["fp16-scaler"] == "pass"
    assert "ACCUM_STEPS=1 BATCH_SIZE=32 in the script" in result.stderr
    assert CONSTANTS.read_bytes() == before


def test_module_constants_undivided_loss(tmp_path):
    assert_undivided_loss(diagnose(tmp_path, CONSTANTS, "--bug", "no-divide"), CONSTANTS)


def test_module_constants_clip_before_unscale_at_the_clip(tmp_path):
    result = diagnose(tmp_path, CONSTANTS, "--bug", "clip-before-unscale")
    assert result.returncode == 1, result.stderr
    (finding,) = result.record["findings"]
    assert (finding["kind"], finding["rung"]) == ("clip-before-unscale", "fp16-scaler")
    assert finding["location"]["line"] == marked_line(CONSTANTS, "clip-before-unscale")


def test_a_dict_literal_in_main(tmp_path):
    healthy = diagnose(tmp_path, DICT)
    assert healthy.returncode == 0, healthy.stderr
    assert [(i["name"], i["value"]) for i in healthy.record["reference_literals"]] == [
        ("grad_accum_steps", 1), ("batch_size", 18)]
    broken = diagnose(tmp_path, DICT, "no-divide")
    assert broken.returncode == 1, broken.stderr
    (finding,) = broken.record["findings"]
    assert finding["kind"] == "missing-accumulation-average"
    assert finding["evidence"]["ratio"] == pytest.approx(3.0, rel=1e-3)
    assert finding["location"]["line"] == marked_line(DICT, "missing-accumulation-average")


def test_an_option_for_one_and_a_literal_for_the_other(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\n"
                      "p.add_argument('--batch-size', type=int, default=8)\n"
                      "args = p.parse_args()\nGRAD_ACCUM = 4\n")
    inferred = infer_reference(str(script), ["--batch-size", "2"], cwd=str(tmp_path))
    assert inferred.args == ["--batch-size", "8"]
    assert inferred.rewrites == [("K", "GRAD_ACCUM", 5, 13, 1)]


def test_a_name_written_twice_is_refused_naming_both_lines(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("ACCUM_STEPS = 4\nbatch_size = 8\n\n\ndef evaluate():\n"
                      "    batch_size = 64\n")
    with pytest.raises(UsageError) as caught:
        infer_reference(str(script), [], cwd=str(tmp_path))
    assert "batch_size = 8 at line 2" in caught.value.message
    assert "batch_size = 64 at line 6" in caught.value.message
    result = run_cli("diagnose", script, cwd=tmp_path)
    assert result.returncode == 2 and "several places" in result.stderr


def test_export_test_infers_such_a_reference_again():
    text = render({"name": "train", "script": "/p/train.py", "args": ["--bug", "x"],
                   "reference_args": ["--bug", "x"], "reference_args_origin": "inferred",
                   "verdict": "failed", "findings": [], "rungs": []}, None,
                  Path("/p/tests/test_train.py"))
    assert "reference_args=" not in text and "inferred again" in text


def test_init_proposes_the_script_mode_command_with_the_reference_inferred(tmp_path):
    result = run_cli("init", CONSTANTS, "-o", tmp_path / "triage.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ampdoctor diagnose {CONSTANTS} --"
    line = _line(CONSTANTS, "ACCUM_STEPS = 4")
    assert f"ACCUM_STEPS = 4 (hardcoded_constants.py:{line}) -> 1" in \
        " ".join(result.stderr.split())


HF = SCRIPTS / "hf_trainer_hardcoded.py"


def test_an_hf_trainer_whose_training_arguments_are_written_in_the_script(tmp_path):
    """TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=4, ...):
    the call's keywords are the literals (K = b = 4 too: the tie a script cannot re-split)."""
    pytest.importorskip("transformers")
    healthy = diagnose(tmp_path, HF)
    assert healthy.returncode == 0, healthy.stderr
    assert [(i["name"], i["value"]) for i in healthy.record["reference_literals"]] == [
        ("gradient_accumulation_steps", 1), ("per_device_train_batch_size", 16)]
    statuses = {r["id"]: r["status"] for r in healthy.record["rungs"]}
    assert statuses["fp32-accum"] == statuses["bf16-no-scaler"] == "pass"
    broken = diagnose(tmp_path, HF, "mean-loss")
    assert broken.returncode == 1, broken.stderr
    (finding,) = broken.record["findings"]
    assert (finding["kind"], finding["rung"]) == ("missing-accumulation-average", "fp32-accum")
    assert finding["location"]["line"] == marked_line(SCRIPTS / "hf_trainer_lm.py",
                                                      "missing-accumulation-average")
