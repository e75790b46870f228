"""Script mode on what a forward is given beyond its rows: a model that normalises over the
batch (BatchNorm), whose correct accumulation is the mean of the micro-batches' own gradients,
not the full batch's, and a 0-d tensor argument (transformers' `num_items_in_batch`), a count,
not rows of data. Each case is an unmodified script of recipes/scripts/ through the real CLI,
its reference inferred from its options (no --reference-args), as a user first runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RECIPES, marked_line, run_cli

SCRIPTS = RECIPES / "scripts"
NUM_ITEMS = SCRIPTS / "gpt2_num_items.py"

pytestmark = pytest.mark.xdist_group("script_mode")


def diagnose(tmp_path: Path, script: Path, *args: str):
    return run_cli("diagnose", script, "--json", "--out", tmp_path / "runs", "--", *args)


def first_error(record: dict) -> dict:
    return next(f for f in record["findings"] if f["severity"] == "error")


def healthy(result) -> dict:
    """The record of a clean diagnose, its accumulation and fp16 rungs passed."""
    assert result.returncode == 0, result.stderr
    record = result.record
    assert (record["verdict"], record["findings"]) == ("healthy", [])
    statuses = {r["id"]: r["status"] for r in record["rungs"]}
    assert statuses["fp32-accum"] == statuses["fp16-scaler"] == "pass"
    return record


def test_a_0d_count_given_to_the_forward_is_not_data(tmp_path):
    """`num_items_in_batch`, the window's tokens as a 0-d tensor, goes to each of the run's K
    forwards and to the reference's one: a count, not rows, so the reference still reads the
    run's data, and the tokens counted once make every rung pass."""
    record = healthy(diagnose(tmp_path, NUM_ITEMS, "--fp16"))
    assert not any("does not read" in n for n in record["notes"])


def test_gpt2_averaged_per_micro_batch_is_still_a_weighted_average_mismatch(tmp_path):
    result = diagnose(tmp_path, NUM_ITEMS, "--fp16", "--loss-average", "micro-batch")
    assert result.returncode == 1, result.stderr
    found = first_error(result.record)
    assert (found["rung"], found["kind"]) == ("fp32-accum", "weighted-average-mismatch")
    assert found["location"]["line"] == marked_line(NUM_ITEMS, "weighted-average-mismatch")
    assert found["evidence"]["weights"] == [0.25] * 4
    assert found["evidence"]["reference_weights"] != [0.25] * 4

