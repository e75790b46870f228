"""`ampdoctor.watch`: the sentinel inside a real training loop (issue 37, part 2).

The loop is `recipes/watch/plain_loop.py`, the PyTorch AMP recipe with accumulation watched the
documented way; each classic bug is planted by an argument and marked `# BUG: <kind>` on its
line. Every check runs the real loop with and without the sentinel.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

import ampdoctor
from conftest import RECIPES, marked_line, run_cli_process

LOOP = RECIPES / "watch" / "plain_loop.py"
sys.path.insert(0, str(LOOP.parent))
from plain_loop import train  # noqa: E402


def _run(bug: str, precision: str, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(bug, precision, **kwargs)


def _found(watch) -> dict[str, tuple[str, int | None]]:
    return {f["kind"]: (f["severity"], f["location"] and f["location"]["line"])
            for f in watch.record["findings"]}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_training_is_bit_identical_with_the_sentinel(precision):
    """50 optimizer steps (200 micro-batches, dropout on, a check every 5 steps): the weights,
    the optimizer's state, the scaler and the random state end as they end without it."""
    torch.manual_seed(0)
    watched_model, watch = _run("none", precision, steps=50, every=5)
    rng_watched = torch.get_rng_state()
    plain_model, _ = _run("none", precision, steps=50, watched=False)
    rng_plain = torch.get_rng_state()
    for (name, a), b in zip(watched_model.state_dict().items(),
                            plain_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(rng_watched, rng_plain)
    assert len(watch.checked) >= 10            # the expensive check ran, on many windows
    assert watch.record["verdict"] == "healthy" and watch.record["findings"] == []


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_healthy_loop_is_silent(precision):
    _, watch = _run("none", precision)
    assert watch.record["verdict"] == "healthy"
    assert watch.findings == []
    assert all(c["ok"] for c in watch.checked)
    assert watch.checked[0]["step"] == 1        # the second window is checked at once


@pytest.mark.parametrize(("bug", "precisions"), [
    ("missing-accumulation-average", ["fp32", "bf16", "fp16"]),
    ("double-average", ["fp32", "bf16", "fp16"]),
    ("zero-grad-inside-accumulation", ["fp32", "fp16"]),
    ("scheduler-per-microbatch", ["fp32", "bf16"]),
    ("clip-before-unscale", ["fp16"]),
    ("frequent-skips", ["fp16"]),
])
def test_each_classic_bug_is_named_at_its_line(bug, precisions):
    for precision in precisions:
        _, watch = _run(bug, precision)
        found = _found(watch)
        assert watch.record["verdict"] == "failed", (precision, found)
        severity, line = found[bug]
        assert severity == "error"
        assert line == marked_line(LOOP, bug), (precision, found)
        # the expensive check never names a second kind for what a cheap one explained
        assert "gradient-mismatch" not in found


def test_the_numbers_are_the_ladder_s():
    _, watch = _run("missing-accumulation-average", "fp32")
    finding = next(f for f in watch.findings if f.kind == "missing-accumulation-average")
    assert finding.rung == "watch"
    assert finding.evidence["measured"] == pytest.approx(4.0, rel=1e-3)
    assert finding.evidence["factor"] == 4 and finding.evidence["cosine"] == pytest.approx(1.0)
    assert "= the sum of the K=4 micro-batch gradients" in finding.message
    _, watch = _run("double-average", "bf16")
    finding = next(f for f in watch.findings if f.kind == "double-average")
    assert finding.evidence["measured"] == pytest.approx(0.25, rel=0.05)


def test_a_clip_that_bites_does_not_hide_a_missing_average():
    """Both the run and the reference clip to 1.0 here, so the update matches; the gradient
    before the clip (what the clip returned) is still K x the reference's."""
    _, watch = _run("missing-accumulation-average", "fp32")
    first = watch.checked[0]
    assert first["ratio"] == pytest.approx(4.0, rel=1e-3) and first["ok"] is False


def test_on_error_raise_stops_the_training_at_the_step():
    with pytest.raises(ampdoctor.WatchError, match="missing-accumulation-average") as info:
        _run("missing-accumulation-average", "fp32", on_error="raise")
    assert info.value.finding.location.line == marked_line(LOOP, "missing-accumulation-average")


def test_the_sentinel_leaves_torch_as_it_found_it():
    backward, clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_
    model, watch = _run("none", "fp16")
    assert torch.Tensor.backward is backward and torch.nn.utils.clip_grad_norm_ is clip
    assert "zero_grad" not in watch.optimizer.__dict__ and "step" not in watch.scaler.__dict__
    with pytest.raises(ampdoctor.WatchError):
        _run("zero-grad-inside-accumulation", "fp32", on_error="raise")
    assert torch.Tensor.backward is backward and torch.nn.utils.clip_grad_norm_ is clip


def test_the_record_is_a_run_record_report_renders(tmp_path):
    _, watch = _run("clip-before-unscale", "fp16", out=tmp_path)
    saved = list(tmp_path.glob("*.json"))
    assert len(saved) == 1
    record = json.loads(saved[0].read_text())
    assert record["verdict"] == "failed" and record["failed_rung"] == "watch"
    assert record["rungs"][0]["id"] == "watch" and record["exit_code"] == 1
    proc = run_cli_process("report", saved[0])
    assert proc.returncode == 0, proc.stderr
    assert "clip-before-unscale" in proc.stdout and "plain_loop.py:" in proc.stdout
    html = tmp_path / "page.html"
    proc = run_cli_process("report", saved[0], "--html", "-o", html)
    assert proc.returncode == 0, proc.stderr
    assert "clip-before-unscale" in html.read_text()


def test_bad_arguments_are_said_plainly():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, text in [({"accumulation_steps": 0}, "accumulation_steps"),
                         ({"accumulation_steps": 2, "every": 0}, "every"),
                         ({"accumulation_steps": 2, "on_error": "panic"}, "on_error")]:
        with pytest.raises(ValueError, match=text):
            ampdoctor.watch(model, opt, **kwargs)
