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
BN = SCRIPTS / "bn_cnn.py"
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


def test_a_batchnorm_cnn_accumulated_correctly_is_healthy(tmp_path):
    """Each micro-batch of 8 images normalises over itself: the run's window gradient is the
    mean of the micro-batches' own gradients exactly, not the full batch of 32's."""
    record = healthy(diagnose(tmp_path, BN))
    assert any("normalises over the batch (1 (BatchNorm2d))" in n and
               "micro-batches' own fp32 gradients" in n for n in record["notes"])


def test_a_batchnorm_cnn_without_the_average_is_named_without_a_token_weighting(tmp_path):
    result = diagnose(tmp_path, BN, "--no-average")
    assert result.returncode == 1, result.stderr
    found = first_error(result.record)
    assert (found["rung"], found["kind"]) == ("fp32-accum", "missing-accumulation-average")
    assert found["location"]["line"] == marked_line(BN, "missing-accumulation-average")
    evidence = found["evidence"]
    # before the clip: K = 4 times the reference, and exactly the sum of the micro-batches'
    assert evidence["measured"] == pytest.approx(4, rel=1e-3)
    assert evidence["hypothesis_error"] < 1e-4
    # the reference weighs the micro-batches as the loop does: no second (weighting) mistake
    assert "weighting_ratio" not in evidence and "reference_weights" not in evidence
    assert "token" not in found["message"] + found.get("fix", "")


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


@pytest.mark.parametrize("loss_sums", [False, True], ids=["loss-averages", "loss-sums"])
def test_the_batchnorm_reference_is_the_mean_or_the_sum_the_full_batch_is_nearer(loss_sums):
    """`per_microbatch_full`: the full batch's gradient differs from the right combination of
    the micro-batches' by its batch statistics only, far less than the factor K between their
    mean and their sum; without it, the mean."""
    import torch

    from ampdoctor.reference import per_microbatch_full

    g = torch.Generator().manual_seed(0)
    per = [{"w": torch.randn(5, generator=g), "b": None} for _ in range(4)]
    mean = torch.stack([p["w"] for p in per]).mean(0)
    right = mean * 4 if loss_sums else mean
    whole = {"w": right * 1.05 + 0.01 * torch.randn(5, generator=g), "b": None}
    got = per_microbatch_full(per, whole)
    assert torch.allclose(got["w"], right) and got["b"] is None
    assert torch.allclose(per_microbatch_full(per, None)["w"], mean)
