"""End-to-end with the real frameworks (CPU wheels): loops written the way accelerate, Fabric
and Lightning document them. Healthy ones pass with no error, and the fp16 rung that the
framework did not run as asked (accelerate's fp32, Lightning's bf16-mixed on a CPU) is a skip
that says what ran and where it was asked; each bug is named with its kind, number and line.
Skipped, with the reason, where a framework is not installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import CONFIGS, RECIPES, marked_line, run_cli

FRAMEWORK_CONFIGS = CONFIGS / "frameworks"
FRAMEWORK_RECIPES = RECIPES / "frameworks"

NEEDS = {"accelerate": "accelerate", "fabric": "lightning", "lightning": "lightning",
         "trainer": "transformers"}


def _framework(name: str) -> str:
    return next(key for key in NEEDS if f"_{key}" in name)


def _diagnose(name: str, tmp_path):
    module = NEEDS[_framework(name)]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'ampdoctor[hf]' or "
                    "'ampdoctor[lightning]')")
    result = run_cli("diagnose", str(FRAMEWORK_CONFIGS / f"{name}.yaml"), "--json",
                     "--out", str(tmp_path))
    return result, json.loads(result.stdout)


def _rung(record, rung_id):
    return next(r for r in record["rungs"] if r["id"] == rung_id)


# healthy config -> (framework named in the fp16 skip, precision it ran, recipe line asked)
HEALTHY = {
    "healthy_accelerate": ("accelerate", "fp32", "accelerate_loops.py:18"),
    "healthy_fabric": ("Fabric", "bf16", "fabric_loops.py:12"),
    "healthy_lightning": ("Lightning", "bf16", "lightning_loops.py:49"),
    "healthy_lightning_manual": ("Lightning", "bf16", "lightning_loops.py:49"),
    # the Trainer builds the Accelerator: the line that asked is the TrainingArguments(...)
    "healthy_trainer": ("accelerate", "fp32", "trainer_loops.py:42"),
}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_framework_loop_passes_and_names_the_precision_that_ran(name, tmp_path):
    result, record = _diagnose(name, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:]
    assert record["findings"] == []
    for rung in ("reproducibility", "fp32-accum", "bf16-no-scaler", "clip-space"):
        assert _rung(record, rung)["status"] == "pass", _rung(record, rung)
    fp16 = _rung(record, "fp16-scaler")
    framework, ran, asked_at = HEALTHY[name]
    assert fp16["status"] == "skip"
    assert f"{framework} ran {ran}, not the fp16" in fp16["summary"]
    assert f"(asked at {asked_at})" in fp16["summary"]
    facts = fp16["details"]["framework_precision"]
    assert facts["precision_ran"] == ran and facts["framework"] == framework
    assert facts["asked_at"].endswith(asked_at)


# broken config -> (kind, measured band, recipe file, the party the message says divides)
BROKEN = {
    # accelerator.backward divides by K itself: a second / K in the loop makes it 1/K
    "broken_accelerate_double_average": ("double-average", (0.249, 0.251),
                                         "accelerate_loops.py", "accelerate"),
    # a scheduler not handed to accelerator.prepare steps on every micro-batch
    "broken_accelerate_scheduler_not_prepared": ("scheduler-per-microbatch", (4, 4),
                                                 "accelerate_loops.py", None),
    # fabric.backward does not divide: the loop must
    "broken_fabric_missing_average": ("missing-accumulation-average", (3.99, 4.01),
                                      "fabric_loops.py", "Fabric"),
    # manual optimization: the user divides (Lightning only does it in automatic mode)
    "broken_lightning_manual_missing_average": ("missing-accumulation-average", (3.99, 4.01),
                                                "lightning_loops.py", "Lightning"),
}
SAYS = {"accelerate": "`accelerator.backward` already divides", "Fabric": "`fabric.backward` "
        "does not divide", "Lightning": "with manual optimization (`manual_backward`) the loop "
        "must divide", "HF Trainer": "accepts loss kwargs: it passes `num_items_in_batch`"}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_framework_loop_is_named_at_the_users_line(name, tmp_path):
    kind, (low, high), recipe, party = BROKEN[name]
    result, record = _diagnose(name, tmp_path)
    assert result.returncode == 1, result.stdout[-2000:]
    assert record["failed_rung"] == "fp32-accum"
    finding = record["findings"][0]
    assert finding["kind"] == kind
    assert low <= finding["evidence"]["measured"] <= high
    path = FRAMEWORK_RECIPES / recipe
    assert finding["location"]["file"].endswith(f"frameworks/{recipe}")
    assert finding["location"]["line"] == marked_line(path, kind)
    assert finding["evidence"].get("framework") == party
    if party is not None:
        assert SAYS[party] in finding["message"]


def test_trainer_loss_that_ignores_num_items_is_a_missing_average(tmp_path):
    """A model whose forward accepts the Trainer's loss kwargs: the Trainer leaves the division
    by K to the loss (num_items_in_batch), and a loss that ignores it sums K micro-batches."""
    result, record = _diagnose("broken_trainer_loss_ignores_num_items", tmp_path)
    assert result.returncode == 1, result.stdout[-2000:]
    finding = record["findings"][0]
    assert (record["failed_rung"], finding["kind"]) == ("fp32-accum",
                                                        "missing-accumulation-average")
    assert 3.99 <= finding["evidence"]["measured"] <= 4.01
    assert finding["evidence"]["framework"] == "HF Trainer"
    assert SAYS["HF Trainer"] in finding["message"]
    # the backward is the Trainer's own: the finding names the user's line that started it
    # (naming the loss line inside the model's forward is not done yet: docs/frameworks.md)
    path = FRAMEWORK_RECIPES / "trainer_loops.py"
    assert finding["location"]["file"] == str(path.resolve())
    assert "trainer.train()" in path.read_text().splitlines()[finding["location"]["line"] - 1]
