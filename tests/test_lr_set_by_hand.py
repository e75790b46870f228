"""scheduler-per-microbatch for a learning rate the loop assigns by hand
(`param_group["lr"] = get_lr(it)`), with no scheduler object: the rate may change only between
windows; one that changes inside a window is judged by what the same loop at K = 1 assigns to
each optimizer step. The rates below are computed here from the recipes' formulas."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from ampdoctor.rules.lr_set_by_hand import _beyond_a_step
from conftest import CONFIGS, RECIPES, marked_line, run_cli

pytestmark = pytest.mark.xdist_group("lr_set_by_hand")


def _nanogpt_lr(it, lr=1e-3, min_lr=1e-4, warmup=8, decay=40):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (decay - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def test_a_rate_counted_in_micro_batches_is_named_with_its_numbers_and_line(tmp_path):
    result = run_cli("diagnose", CONFIGS / "broken_lr_set_per_microbatch.yaml", "--json",
                     "--out", tmp_path)
    assert result.returncode == 1, result.stderr
    finding = result.record["findings"][0]
    assert (finding["kind"], finding["rung"], finding["severity"]) == (
        "scheduler-per-microbatch", "fp32-accum", "error")
    K = 4
    evidence = finding["evidence"]
    # step 0 ran after micro-batches 0..3 set get_lr(0..3): it used get_lr(3); at K = 1 the
    # loop's first step is its first iteration: get_lr(0)
    assert evidence["lr_used"] == pytest.approx(_nanogpt_lr(K - 1), rel=1e-9)
    assert evidence["lr_expected"] == pytest.approx(_nanogpt_lr(0), rel=1e-9)
    assert (evidence["first_step_off"], evidence["measured"], evidence["expected"]) == (0, K, 1)
    recipe = RECIPES / "broken_lr_set_per_microbatch.py"
    assert finding["location"]["line"] == marked_line(recipe, "scheduler-per-microbatch")
    assert Path(finding["location"]["file"]).resolve() == recipe.resolve()
    assert "optimizer-step counter" in finding["fix"]


def _spec(tmp_path: Path, body: str) -> Path:
    head = ("import math\n"
            "import torch.nn.functional as F\n"
            "\n"
            "\n"
            "def train_loop(model, optimizer, micro_batches, run):\n"
            "    K = run.accumulation_steps\n"
            "    for i, (x, y) in enumerate(micro_batches):\n")
    tail = ("        loss = F.mse_loss(model(x), y) / K\n"
            "        loss.backward()\n"
            "        if (i + 1) % K == 0:\n"
            "            optimizer.step()\n"
            "            optimizer.zero_grad()\n")
    (tmp_path / "loop.py").write_text(
        head + textwrap.indent(textwrap.dedent(body).strip("\n") + "\n", " " * 8) + tail)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"project_root: {tmp_path}\nmodel: common:make_mlp\n"
                    "data: common:make_regression_data\ntrain_loop: loop:train_loop\n"
                    "accumulation_steps: 4\nmicro_batch_size: 8\noptimizer_steps: 3\n"
                    f"device: cpu\nseed: 0\nrungs: [fp32-accum]\n")
    (tmp_path / "common.py").write_text((RECIPES / "common.py").read_text())
    return spec


@pytest.mark.parametrize("name, body, broken", [
    # a decay from a micro-batch counter, through param_group.update: 4 values per window
    ("cosine per micro-batch", """
        for group in optimizer.param_groups:
            group.update(lr=0.5e-3 * (1 + math.cos(math.pi * i / 12)))
        """, True),
    # the same decay from the optimizer step (i // K): assigned every micro-batch, one value
    ("cosine per optimizer step", """
        for group in optimizer.param_groups:
            group.update(lr=0.5e-3 * (1 + math.cos(math.pi * (i // K) / 12)))
        """, False),
    # a fractional step (i / K): the rate moves inside a window but stays within a step of
    # the schedule: harmless
    ("warm-up from a fractional step", """
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * min(1.0, (i / K + 1) / 3)
        """, False),
])
def test_which_hand_set_rates_are_mistakes(tmp_path, name, body, broken):
    result = run_cli("diagnose", _spec(tmp_path, body), "--json", "--out", tmp_path / "runs")
    kinds = [f["kind"] for f in result.record["findings"]]
    if not broken:
        assert (result.returncode, kinds) == (0, []), (name, result.record["findings"])
        return
    assert result.returncode == 1 and kinds == ["scheduler-per-microbatch"], kinds
    evidence = result.record["findings"][0]["evidence"]
    assert evidence["lr_used"] == pytest.approx(0.5e-3 * (1 + math.cos(math.pi * 3 / 12)))
    assert evidence["lr_expected"] == pytest.approx(1e-3)
    assert result.record["findings"][0]["location"]["line"] == 9    # the group.update line


def test_within_a_step_of_the_schedule_is_not_a_mistake():
    meant = [1.0, 2.0, 3.0, 4.0]
    assert not _beyond_a_step(1.75, meant, 0)      # between step 0's and step 1's values
    assert not _beyond_a_step(3.0, meant, 1)       # step 2's value at step 1: one step ahead
    assert _beyond_a_step(3.5, meant, 1)           # beyond the next step's
    assert _beyond_a_step(4.0, meant, 0)           # three steps ahead (K = 4, micro-batches)
    assert not _beyond_a_step(4.0, meant, 3)       # the last step, its own value
    # the last step has no step after it: the pace from the step before stands in (5.0)
    assert not _beyond_a_step(4.75, meant, 3)
    assert _beyond_a_step(5.5, meant, 3)


def test_a_warm_up_read_at_a_fractional_step_is_healthy_to_the_last_step(tmp_path):
    """MAE's shape (the rate set every micro-batch from `it / K`, a warm-up still rising at
    the last step compared): the last step's rate lies between its own and the next step's,
    which the K = 1 run does not reach (flagged before)."""
    result = run_cli("diagnose", CONFIGS / "healthy_lr_fraction_per_microbatch.yaml", "--json",
                     "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy" and result.record["findings"] == []
