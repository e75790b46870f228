"""The reference inferred for scripts whose options another library than argparse makes
(recipes/scripts/clis/): click's `@click.option`, python-fire's and typer's function
parameters (`--batch_size` / `--batch-size`, `typer.Option(4, "--accum-steps")`), the fields of
a dataclass HfArgumentParser parses, a tyro dataclass (`--batch-size`). Read from the script's
text, not run; end to end, the bug is found at its line and the healthy run is healthy."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampdoctor.script.infer import infer_reference
from conftest import RECIPES, assert_undivided_loss, run_cli

CLIS = RECIPES / "scripts" / "clis"
pytestmark = pytest.mark.xdist_group("script_mode")


@pytest.mark.parametrize("script, args, reference", [
    ("click_cli.py", [], ["--grad-accum", "1", "--batch-size", "32"]),
    ("click_cli.py", ["-b", "4", "--grad-accum=2"], ["-b", "8", "--grad-accum=1"]),
    ("fire_cli.py", [], ["--gradient_accumulation_steps", "1", "--batch_size", "32"]),
    ("fire_cli.py", ["--batch-size", "4"], ["--batch-size", "16",
                                             "--gradient_accumulation_steps", "1"]),
    ("typer_cli.py", ["--accum-steps", "2"], ["--accum-steps", "1", "--batch-size", "16"]),
    ("hf_dataclass_cli.py", ["--per-device-train-batch-size", "2"],
     ["--per-device-train-batch-size", "8", "--gradient_accumulation_steps", "1"]),
])
def test_the_reference_is_k_1_and_the_whole_window(script, args, reference):
    assert infer_reference(str(CLIS / script), args).args == reference


def test_a_tyro_dataclass_spells_its_options_with_dashes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import dataclasses\nimport tyro\n\n\n@dataclasses.dataclass\n"
                      "class Config:\n    micro_batch_size: int = 4\n"
                      "    grad_accum_steps: int = 8\n    lr: float = 1e-3\n\n\n"
                      "config = tyro.cli(Config)\n")
    inferred = infer_reference(str(script), [])
    assert inferred.args == ["--grad-accum-steps", "1", "--micro-batch-size", "32"]


def test_a_function_with_positional_only_parameters(tmp_path):
    """`def main(seed, /, batch_size=8, grad_accum=4)`: the defaults line up with the
    parameters after the positional-only ones too (it raised on the unequal lengths)."""
    script = tmp_path / "train.py"
    script.write_text("import fire\n\n\ndef main(seed=0, /, batch_size=8, grad_accum=4):\n"
                      "    pass\n\n\nfire.Fire(main)\n")
    assert infer_reference(str(script), []).args == ["--grad_accum", "1", "--batch_size", "32"]


def diagnose(tmp_path: Path, script: str, *args: str):
    return run_cli("diagnose", CLIS / script, "--json", "--out", tmp_path / "runs",
                   "--steps", "3", "--", *args, cwd=CLIS)


@pytest.mark.parametrize("script", ["click_cli.py", "fire_cli.py"])
def test_healthy_runs_are_healthy_with_the_inferred_reference(tmp_path, script):
    result = diagnose(tmp_path, script)
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy" and result.record["findings"] == []
    assert result.record["reference_args_origin"] == "inferred"
    fp32 = next(r for r in result.record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["status"] == "pass" and fp32["details"]["steps_compared"] == 3


@pytest.mark.parametrize("script, bug", [("typer_cli.py", "--bug"), ("fire_cli.py", "--bug"),
                                         ("hf_dataclass_cli.py", "--bug")])
def test_the_undivided_loss_is_found_at_its_line(tmp_path, script, bug):
    assert_undivided_loss(diagnose(tmp_path, script, bug), CLIS / "common.py")
