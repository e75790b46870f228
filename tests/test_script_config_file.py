"""Script mode on a script configured by a YAML/JSON file it is handed
(recipes/scripts/yaml_config.py --config configs/finetune.yaml): K and the micro-batch are keys
of the file, not options. The reference is inferred as a copy of the file with K = 1 and the
batch K times the micro-batch, in a folder of ampdoctor's own that is gone when the command
ends; the user's file is untouched. An evaluation section's batch size is not the training's;
a key found in two training sections is exit 2 naming both."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from ampdoctor.core.errors import UsageError
from ampdoctor.script.infer import infer_reference
from conftest import RECIPES, assert_undivided_loss, run_cli

SCRIPTS = RECIPES / "scripts"
SCRIPT = SCRIPTS / "yaml_config.py"
CONFIG = SCRIPTS / "configs" / "finetune.yaml"
pytestmark = pytest.mark.xdist_group("script_mode")


def diagnose(tmp_path: Path, *args: str):
    return run_cli("diagnose", SCRIPT, "--json", "--out", tmp_path / "runs", "--steps", "3",
                   "--", "--config", "configs/finetune.yaml", *args, cwd=SCRIPTS)


def test_healthy_the_reference_reads_a_copy_and_the_users_file_is_untouched(tmp_path):
    before = (CONFIG.read_bytes(), CONFIG.stat().st_mtime_ns)
    result = diagnose(tmp_path)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert record["reference_args_origin"] == "inferred"
    fp32 = next(r for r in record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["status"] == "pass" and fp32["details"]["steps_compared"] == 3
    copy = Path(record["reference_args"][1])
    assert copy.name == "finetune.yaml" and copy != CONFIG
    assert not copy.parent.parent.exists()          # removed when the command ended
    assert (CONFIG.read_bytes(), CONFIG.stat().st_mtime_ns) == before
    assert "train.gradient_accumulation_steps 4 (config configs/finetune.yaml) -> 1" in \
        result.stderr
    assert "train.batch_size 8 (config configs/finetune.yaml) -> 32" in result.stderr


def test_loss_not_divided_is_named_at_its_backward(tmp_path):
    result = diagnose(tmp_path, "--bug", "no-divide")
    assert_undivided_loss(result, SCRIPT)


def test_the_copy_holds_k_1_and_the_whole_window_and_the_rest_as_it_was():
    inferred = infer_reference(str(SCRIPT), ["--config", str(CONFIG)], cwd=str(SCRIPTS))
    assert (inferred.K, inferred.micro_batch) == (4, 8)
    copy = yaml.safe_load(Path(inferred.args[1]).read_text())
    original = yaml.safe_load(CONFIG.read_text())
    assert copy["train"]["gradient_accumulation_steps"] == 1
    assert copy["train"]["batch_size"] == 32
    assert copy["eval"] == original["eval"] and copy["model"] == original["model"]
    assert {k: v for k, v in copy["train"].items()
            if k not in ("gradient_accumulation_steps", "batch_size")} == \
        {k: v for k, v in original["train"].items()
         if k not in ("gradient_accumulation_steps", "batch_size")}


def _script(tmp_path: Path, options: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\n" + options +
                      "args = p.parse_args()\n")
    return script


def test_a_json_file_given_joined_with_k_an_option_and_the_batch_in_the_file(tmp_path):
    script = _script(tmp_path, 'p.add_argument("--config")\n'
                               'p.add_argument("--grad-accum", type=int, default=2)\n')
    (tmp_path / "cfg.json").write_text(json.dumps({"data": {"per_device_train_batch_size": 6,
                                                            "workers": 2}}))
    inferred = infer_reference(str(script), ["--config=cfg.json", "--grad-accum", "3"],
                               cwd=str(tmp_path))
    assert (inferred.K, inferred.micro_batch) == (3, 6)
    option, path = inferred.args[0].split("=", 1)
    assert option == "--config" and inferred.args[1:] == ["--grad-accum", "1"]
    assert json.loads(Path(path).read_text()) == {"data": {"per_device_train_batch_size": 18,
                                                           "workers": 2}}
    assert json.loads((tmp_path / "cfg.json").read_text())["data"][
        "per_device_train_batch_size"] == 6


def test_a_key_in_two_training_sections_is_refused_naming_both(tmp_path):
    script = _script(tmp_path, 'p.add_argument("config")\n')
    (tmp_path / "gan.yaml").write_text("generator: {batch_size: 8}\n"
                                       "discriminator: {batch_size: 16}\n"
                                       "accumulate: 4\n")
    with pytest.raises(UsageError) as caught:
        infer_reference(str(script), ["gan.yaml"], cwd=str(tmp_path))
    assert "generator.batch_size" in caught.value.message
    assert "discriminator.batch_size" in caught.value.message
    result = run_cli("diagnose", script, "--", "gan.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "several places" in result.stderr and "Traceback" not in result.stderr
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("ampdoctor-reference-*/0/gan.yaml"))


def test_a_config_without_the_keys_still_says_what_to_give(tmp_path):
    script = _script(tmp_path, 'p.add_argument("--config")\n')
    (tmp_path / "c.yaml").write_text("lr: 0.1\n")
    result = run_cli("diagnose", script, "--", "--config", "c.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "YAML/JSON config files among its arguments" in result.stderr
