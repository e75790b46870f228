"""Spec mode on loop shapes of the second hunt, end to end through the real CLI (kind, rung,
numbers, the recipe's marked line; the healthy twins exit 0):

- OneCycleLR sized in optimizer steps and stepped per micro-batch raises past total_steps
  inside the run: the steps before the raise name scheduler-per-microbatch at 4x (K), not a
  bare loop-error (exit 3) and not the cut run's 6 scheduler steps per optimizer step;
- a clip on every micro-batch (outside the window's `if`): no known shape, said at the clip
  with how many times it clipped before the window's last backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RECIPES, marked_line

pytestmark = pytest.mark.xdist_group("loop_shapes2")


def the_error(record: dict) -> dict:
    errors = [f for f in record["findings"] if f["severity"] == "error"]
    assert len(errors) == 1, record["findings"]
    return errors[0]


def test_onecycle_per_window_is_healthy(diagnosed):
    result = diagnosed("healthy_onecycle_per_window")
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy" and result.record["findings"] == []


def test_onecycle_per_micro_batch_that_raises_is_scheduler_per_microbatch(diagnosed):
    result = diagnosed("broken_onecycle_per_microbatch")
    assert result.returncode == 1, result.stderr
    record = result.record
    assert record["verdict"] == "failed" and record["failed_rung"] == "fp32-accum"
    finding = the_error(record)
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "scheduler-per-microbatch")
    recipe = RECIPES / "broken_onecycle_per_microbatch.py"
    assert Path(finding["location"]["file"]).resolve() == recipe.resolve()
    assert finding["location"]["line"] == marked_line(recipe, "scheduler-per-microbatch")
    evidence = finding["evidence"]
    # 4 scheduler steps before optimizer step 0, the 7th raises: K = 4 per interval
    assert evidence["measured"] == 4 and evidence["max_between_optimizer_steps"] == 4
    assert (evidence["scheduler_steps"], evidence["optimizer_steps"]) == (6, 1)
    assert "It then raised" in finding["message"]


def test_a_clip_on_every_micro_batch_is_named_at_the_clip(diagnosed):
    result = diagnosed("broken_clip_every_microbatch")
    assert result.returncode == 1, result.stderr
    finding = the_error(result.record)
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "gradient-mismatch")
    recipe = RECIPES / "broken_clip_every_microbatch.py"
    assert finding["location"]["line"] == marked_line(recipe, "gradient-mismatch")
    assert finding["evidence"]["early_clips"] == 3 and finding["evidence"]["step"] == 0
    assert "clipped 3 time(s) before its last backward" in finding["message"]


def test_the_clip_twin_is_healthy(diagnosed):
    result = diagnosed("healthy_clip_active")
    assert result.returncode == 0, result.stderr
    assert result.record["findings"] == []
