"""Script mode compares the learning rate each optimizer step used with the reference's (the
same script without accumulation): a rate scaled by the micro-batch, or a schedule counted in
micro-batches, makes every update differ though each gradient matches (`script.lrs`). The
real CLI on recipes/scripts/lr_scaling.py, healthy and broken each way."""

from __future__ import annotations

import math

import pytest

from conftest import RECIPES, marked_line, run_cli

SCRIPT = RECIPES / "scripts" / "lr_scaling.py"
pytestmark = pytest.mark.xdist_group("script_mode")

# the script's data: 640 rows, micro-batch 8, K = 4, 3 epochs
ROWS, B, K, EPOCHS, BLR = 640, 8, 4, 3, 1e-3


def diagnose(tmp_path, *args: str):
    return run_cli("diagnose", SCRIPT, "--json", "--out", tmp_path / "runs", "--", *args)


def the_error(record: dict) -> dict:
    errors = [f for f in record["findings"] if f["severity"] == "error"]
    assert len(errors) == 1, record["findings"]
    return errors[0]


@pytest.mark.parametrize("args", [[], ["--schedule", "cosine"]], ids=["warmup", "cosine"])
def test_a_rate_and_schedule_in_optimizer_steps_are_clean(tmp_path, args):
    result = diagnose(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert result.record["findings"] == []
    assert result.record["reference_args"] == [*args, "--accum_iter", "1", "--batch_size", "32"]


def _warmup_lr(batch: int, total: int) -> float:
    return BLR * batch / 256 * min(1.0, 1 / max(1, total // 10))


def test_a_rate_scaled_by_the_micro_batch_is_named_at_the_optimizer(tmp_path):
    result = diagnose(tmp_path, "--lr-batch", "micro-batch")
    assert result.returncode == 1, result.stderr
    found = the_error(result.record)
    assert (found["rung"], found["kind"]) == ("fp32-accum", "gradient-mismatch")
    assert found["location"]["line"] == marked_line(SCRIPT, "gradient-mismatch")
    steps = EPOCHS * (ROWS // B) // K
    used, meant = _warmup_lr(B, steps), _warmup_lr(B * K, steps)
    evidence = found["evidence"]
    assert evidence["step"] == 0
    assert evidence["lr_used"] == pytest.approx(used, rel=1e-6)
    assert evidence["lr_expected"] == pytest.approx(meant, rel=1e-6)
    assert evidence["measured"] == pytest.approx(1 / K, rel=1e-5)
    assert "effective batch" in found["message"]


def test_a_warmup_counted_in_micro_batches_is_named(tmp_path):
    result = diagnose(tmp_path, "--schedule-steps", "micro-batches")
    assert result.returncode == 1, result.stderr
    found = the_error(result.record)
    assert found["kind"] == "gradient-mismatch" and found["evidence"]["step"] == 0
    run_total, ref_total = EPOCHS * (ROWS // B), EPOCHS * (ROWS // (B * K))
    assert found["evidence"]["measured"] == pytest.approx(
        _warmup_lr(B * K, run_total) / _warmup_lr(B * K, ref_total), rel=1e-5)


def test_a_cosine_counted_in_micro_batches_is_named_at_the_scheduler(tmp_path):
    result = diagnose(tmp_path, "--schedule", "cosine", "--schedule-steps", "micro-batches")
    assert result.returncode == 1, result.stderr
    found = the_error(result.record)
    assert found["kind"] == "gradient-mismatch"
    # step 0 starts both cosines at the base rate; step 1 has moved 1/total of each
    assert found["evidence"]["step"] == 1
    assert found["location"]["line"] == marked_line(SCRIPT, "schedule-pace")
    run_total, ref_total = EPOCHS * (ROWS // B), EPOCHS * (ROWS // (B * K))
    ratio = (1 + math.cos(math.pi / run_total)) / (1 + math.cos(math.pi / ref_total))
    assert found["evidence"]["measured"] == pytest.approx(ratio, rel=1e-5)
    assert "optimizer steps" in found["message"]
