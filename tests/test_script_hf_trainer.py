"""An HF Trainer script in script mode, byte for byte: `HfArgumentParser` options give K and
the micro-batch, the reference is inferred, and `trainer.save_model()` (safetensors, written
from Rust into a folder the Trainer made) works in every run without touching the project."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RECIPES, marked_line, run_cli

pytest.importorskip("transformers")
pytestmark = [pytest.mark.xdist_group("script_mode"), pytest.mark.slow]

SCRIPT = RECIPES / "scripts" / "hf_trainer_lm.py"
ARGS = ["--output_dir", "out", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "4", "--max_steps", "3", "--use_cpu",
        "--report_to", "none", "--max_grad_norm", "0.5"]


def test_a_healthy_trainer_script_that_saves_its_model_passes(tmp_path):
    result = run_cli("diagnose", SCRIPT, "--json", "--out", tmp_path / "runs", "--",
                     *ARGS, "--bf16", cwd=tmp_path)
    record = result.record
    assert result.returncode == 0, (result.stderr, record.get("findings"))
    assert (record["verdict"], record["findings"]) == ("healthy", [])
    status = {r["id"]: r["status"] for r in record["rungs"]}
    assert status["fp32-accum"] == "pass" and status["bf16-no-scaler"] == "pass"
    # the reference: the same options with K = 1 and K x b
    reference = record["reference_args"]
    assert reference[reference.index("--gradient_accumulation_steps") + 1] == "1"
    assert reference[reference.index("--per_device_train_batch_size") + 1] == "8"
    assert not (tmp_path / "out").exists()           # the saves went to the scratch folder


def test_a_compute_loss_that_ignores_num_items_is_named_in_the_trainer_s_terms(tmp_path):
    result = run_cli("diagnose", SCRIPT, "--json", "--out", tmp_path / "runs", "--",
                     *ARGS, "--mean_loss_per_micro_batch", "true", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    finding = result.record["findings"][0]
    assert (finding["kind"], finding["rung"]) == ("missing-accumulation-average", "fp32-accum")
    assert 3.99 <= finding["evidence"]["measured"] <= 4.01
    assert finding["evidence"]["framework"] == "HF Trainer"
    assert "num_items_in_batch" in finding["fix"] and "compute_loss" in finding["fix"]
    assert Path(finding["location"]["file"]).resolve() == SCRIPT.resolve()
    assert finding["location"]["line"] == marked_line(SCRIPT, "missing-accumulation-average")
    assert not (tmp_path / "out").exists()
