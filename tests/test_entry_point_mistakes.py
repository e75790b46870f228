"""Mistakes in what the `hf_trainer` / `lightning` keys name, and a script reference of another
model (issue 35): exit 2 with the key and its YAML line, or the loop's real problem (no
optimizer step), never an internal error, a location-free loop-error or a nondeterminism
verdict. The recipes are recipes/frameworks/entry_point_mistakes.py; the specs
sample_configs/bad/frameworks/."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import CONFIGS, RECIPES, run_cli

BAD = CONFIGS / "bad" / "frameworks"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None
    or importlib.util.find_spec("transformers") is None,
    reason="needs lightning and transformers (pip install 'ampdoctor[hf,lightning]')")


def _diagnose(name: str, tmp_path) -> tuple[int, str, dict | None]:
    result = run_cli("diagnose", str(BAD / f"{name}.yaml"), "--json", "--out", str(tmp_path))
    text = " ".join((result.stderr + result.stdout).split())
    record = json.loads(result.stdout) if result.stdout.strip() else None
    return result.returncode, text, record


def _line(name: str, key: str) -> int:
    """The YAML line of `key` (its last part) in the spec."""
    lines = (BAD / f"{name}.yaml").read_text().splitlines()
    return next(n for n, text in enumerate(lines, start=1)
                if text.strip().startswith(key.split(".")[-1] + ":"))


@pytest.mark.parametrize("name, returned", [("hf_factory_no_trainer", "returned None"),
                                            ("hf_factory_trainer_dict", "returned a dict")])
def test_an_hf_factory_that_returns_no_trainer_is_exit_2_at_its_key(name, returned, tmp_path):
    code, text, record = _diagnose(name, tmp_path)
    assert code == 2, text
    assert f"{name}.yaml:{_line(name, 'factory')}: spec key 'hf_trainer.factory'" in text
    assert f"{returned}" in text and "not a transformers Trainer" in text
    assert record is not None and record["verdict"] == "error"
    assert record["error"]["exit_code"] == 2
    assert all(f["kind"] != "loop-error" for f in record["findings"])


@pytest.mark.parametrize("name, key, hint", [
    ("hf_unknown_arg", "hf_trainer.args.learning_rat", "Did you mean 'learning_rate'?"),
    ("lightning_unknown_trainer_key", "lightning.trainer.max_epoch",
     "Did you mean 'max_epochs'?"),
])
def test_an_unknown_framework_setting_is_a_spec_error_at_its_line(name, key, hint, tmp_path):
    code, text, record = _diagnose(name, tmp_path)
    assert code == 2, text
    assert f"{name}.yaml:{_line(name, key)}: spec key '{key}'" in text
    assert hint in text
    assert record is None and "the loop raised" not in text     # no run: a spec error


@pytest.mark.parametrize("name, said", [
    ("lightning_plain_module", "returned a Sequential, not a LightningModule"),
    ("lightning_NoOptimizers", "returned a NoOptimizers, which defines no "
                               "`configure_optimizers`"),
])
def test_a_lightning_module_that_cannot_be_fitted_is_exit_2(name, said, tmp_path):
    code, text, record = _diagnose(name, tmp_path)
    assert code == 2, text
    assert f"{name}.yaml:{_line(name, 'module')}: spec key 'lightning.module'" in text
    assert said in text
    assert "internal error" not in text
    assert record is not None and record["error"]["exit_code"] == 2


def test_a_training_step_returning_none_is_no_optimizer_step_not_nondeterminism(tmp_path):
    code, text, record = _diagnose("lightning_SilentRegressor", tmp_path)
    assert code == 1, text
    assert record is not None and record["failed_rung"] == "fp32-accum"
    kinds = [f["kind"] for f in record["findings"]]
    assert "nondeterministic-baseline" not in kinds and "zero-grad-inside-accumulation" \
        not in kinds
    (finding,) = record["findings"]
    # 3 optimizer steps x K = 4 micro-batches, all taken, no backward
    assert finding["message"].startswith("No optimizer step was taken in 12 micro-batches")
    assert finding["evidence"]["backwards"] == 0
    assert finding["evidence"]["optimizer_steps"] == 3
    assert record["rungs"][0]["id"] == "reproducibility"
    assert record["rungs"][0]["status"] == "pass"


def _mlp_size(width: int) -> int:
    """recipes/scripts/main_dataloader.py's MLP: Linear(16, width), Linear(width, 4)."""
    return 16 * width + width + width * 4 + 4


@pytest.mark.slow
def test_a_script_reference_of_another_model_size_is_exit_2_with_both_sizes(tmp_path):
    result = run_cli("diagnose", str(RECIPES / "scripts" / "main_dataloader.py"), "--out",
                     str(tmp_path), "--reference-args", "--grad-accum 1 --batch-size 32 "
                     "--width 64")
    text = " ".join((result.stderr + result.stdout).split())
    assert result.returncode == 2, text
    assert "--reference-args: the reference builds another model than the run" in text
    assert f"{_mlp_size(64):,} parameters in 4 tensors in the reference" in text
    assert f"{_mlp_size(48):,} parameters in 4 tensors in the run" in text
    assert "`body.0.weight`: (64, 16) in the reference, (48, 16) in the run" in text
