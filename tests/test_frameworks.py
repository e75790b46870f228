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
    # the docs' manual optimization with `sch.step()` under `if (batch_idx + 1) % N == 0`
    "healthy_lightning_manual_scheduler": ("Lightning", "bf16", "lightning_loops.py:49"),
    # transformers' *_no_trainer.py: get_scheduler prepared with the rest, stepped every batch
    "healthy_accelerate_no_trainer": ("accelerate", "fp32", "accelerate_loops.py:70"),
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
                                                 "accelerate_loops.py", "accelerate"),
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
# (kind, framework) -> what the fix must say, and what it must not (the hand-written loop's
# fix, which says the opposite where the framework divides)
FIX_SAYS = {
    ("double-average", "accelerate"): ("Remove your own division",
                                       "keep `loss = criterion(out, y) / accumulation_steps`"),
    ("scheduler-per-microbatch", "accelerate"): ("accelerator.prepare(model, optimizer, "
                                                 "scheduler)", "if (i + 1) % K == 0:"),
    ("missing-accumulation-average", "Fabric"): ("fabric.backward(loss / K)",
                                                 "scaler.scale(loss).backward()"),
    ("missing-accumulation-average", "Lightning"): ("self.manual_backward(loss / N)",
                                                    "scaler.scale(loss).backward()"),
    ("missing-accumulation-average", "HF Trainer"): ("loss_sum / num_items_in_batch",
                                                     "scaler.scale(loss).backward()"),
}


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
    if kind in ("double-average", "missing-accumulation-average"):
        assert SAYS[party] in finding["message"]
    says, never = FIX_SAYS[(kind, party)]
    assert says in finding["fix"] and never not in finding["fix"], finding["fix"]


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
    says, never = FIX_SAYS[("missing-accumulation-average", "HF Trainer")]
    assert says in finding["fix"] and never not in finding["fix"]
    # the backward is the Trainer's own: the finding names the user's loss line in forward
    path = FRAMEWORK_RECIPES / "trainer_loops.py"
    assert finding["location"]["file"] == str(path.resolve())
    assert finding["location"]["line"] == marked_line(path, "missing-accumulation-average")


# --- the hf_trainer and lightning spec keys: no train_loop --------------------------------

def test_hf_trainer_key_builds_the_trainer_of_each_rung(tmp_path):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install 'ampdoctor[hf]')")
    result = run_cli("diagnose", str(FRAMEWORK_CONFIGS / "healthy_hf_trainer_key.yaml"),
                     "--json", "--out", str(tmp_path))
    record = json.loads(result.stdout)
    assert result.returncode == 0, result.stdout[-2000:]
    assert record["findings"] == []
    for rung in ("fp32-accum", "bf16-no-scaler", "clip-space"):
        assert _rung(record, rung)["status"] == "pass"
    # 3 clipped steps: ampdoctor's TrainingArguments carry the spec's max_grad_norm
    assert "3 clipped updates" in _rung(record, "clip-space")["summary"]
    assert _rung(record, "fp16-scaler")["details"]["framework_precision"]["precision_ran"] \
        == "fp32"


def test_hf_trainer_key_finding_is_at_the_compute_loss_line(tmp_path):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install 'ampdoctor[hf]')")
    result = run_cli("diagnose", str(FRAMEWORK_CONFIGS / "broken_hf_trainer_key_sum.yaml"),
                     "--json", "--out", str(tmp_path))
    record = json.loads(result.stdout)
    assert result.returncode == 1
    finding = record["findings"][0]
    assert finding["kind"] == "reduction-mismatch"
    assert 7.99 <= finding["evidence"]["measured"] <= 8.01   # sum over b=8 samples
    path = FRAMEWORK_RECIPES / "entry_points.py"
    assert finding["location"]["line"] == marked_line(path, "reduction-mismatch")


@pytest.mark.parametrize("name, kind", [("healthy_lightning_key", None),
                                        ("broken_lightning_key_manual",
                                         "missing-accumulation-average")])
def test_lightning_key_fits_the_module_with_its_own_optimizers(name, kind, tmp_path):
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (pip install 'ampdoctor[lightning]')")
    result = run_cli("diagnose", str(FRAMEWORK_CONFIGS / f"{name}.yaml"), "--json",
                     "--out", str(tmp_path))
    record = json.loads(result.stdout)
    if kind is None:
        assert result.returncode == 0, result.stdout[-2000:]
        assert record["findings"] == []
        assert _rung(record, "fp16-scaler")["details"]["framework_precision"]["framework"] \
            == "Lightning"
        return
    assert result.returncode == 1
    finding = record["findings"][0]
    assert finding["kind"] == kind and 3.99 <= finding["evidence"]["measured"] <= 4.01
    assert finding["location"]["line"] == marked_line(FRAMEWORK_RECIPES / "entry_points.py",
                                                      kind)
    assert finding["evidence"]["framework"] == "Lightning"


@pytest.mark.parametrize("extra, message", [
    ({"train_loop": "x:y", "lightning": {"module": "m:M"}},
     "this spec gives train_loop and lightning"),
    ({}, "spec key 'train_loop' is missing"),
    ({"hf_trainer": {"factory": "m:f"}}, "spec key 'model' is missing"),
    ({"model": "m:f", "hf_trainer": {"factory": "m:f", "args": {"fp16": True}}},
     "'fp16' is set by ampdoctor for each rung from the spec key 'precisions'"),
    ({"lightning": {"module": "m:M", "trainer": {"accumulate_grad_batches": 2}}},
     "from the spec key 'accumulation_steps'"),
])
def test_entry_point_keys_are_validated_with_the_spec(extra, message, tmp_path):
    spec = {"data": "common:make_regression_data", "accumulation_steps": 4, **extra}
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(spec))
    result = run_cli("diagnose", str(path))
    assert result.returncode == 2
    assert message in " ".join((result.stderr + result.stdout).split())
