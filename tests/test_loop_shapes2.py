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


def test_watch_accelerate_short_last_window_is_the_convention_not_a_mismatch():
    """The documented accelerate loop over data that end in a short window (3 of K = 4
    micro-batches): accelerate divides it by K, its update is 3/4 of its mean. Before: the
    watch warned gradient-mismatch 0.75x at that step, an error on a healthy run."""
    pytest.importorskip("accelerate")
    import sys
    import warnings

    from accelerate.state import AcceleratorState, GradientState
    sys.path.insert(0, str(RECIPES / "watch"))
    from accelerate_loop import train

    def run(bug: str):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return train(bug, "fp32", steps=3, K=4, every=1, tail=3)[1]

    watch = run("none")
    assert watch.record["verdict"] == "healthy" and watch.findings == []
    assert watch.updates == 4
    short = [c for c in watch.checked if c.get("short_window")]
    assert [(c["step"], c["short_window"], c["ratio"]) for c in short] == [(3, 3, 0.75)]
    assert any("a short window of 3 of K=4" in n for n in watch.record["notes"])
    # a division of its own is still named at the first full window
    broken = run("double-average")
    assert [f.kind for f in broken.findings] == ["double-average"]
