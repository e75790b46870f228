"""`ampdoctor.watch_accelerate` around a real accelerate loop (accelerate installed, CPU).

The loop is `recipes/watch/accelerate_loop.py`, written as accelerate's docs write gradient
accumulation; its bug is marked `# BUG: <kind>` on its line. Each run starts from a fresh
accelerate state, the way accelerate's own tests reset it.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

pytest.importorskip("accelerate")

import ampdoctor
from conftest import RECIPES, marked_line

LOOP = RECIPES / "watch" / "accelerate_loop.py"
sys.path.insert(0, str(LOOP.parent))
from accelerate_loop import train  # noqa: E402

K = 4


def _run(bug: str, precision: str = "fp32", **kwargs):
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(bug, precision, K=K, **kwargs)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_healthy_accelerate_loop_is_silent(precision):
    _, watch = _run("none", precision)
    assert watch.record["verdict"] == "healthy" and watch.findings == []
    assert watch.K == K and watch.updates == 8          # K and the steps, from accelerate
    assert len(watch.checked) == 3 and all(c["ok"] for c in watch.checked)
    # bf16 is accelerate's autocast inside the prepared forward; the replay is fp32
    assert {c["precision"] for c in watch.checked} == {precision}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_watched_loop_trains_bit_identically(precision):
    """50 optimizer steps (dropout on, a clip, a replay every 5 steps)."""
    watched, watch = _run("none", precision, steps=50, every=5)
    assert len(watch.checked) == 10 and watch.record["verdict"] == "healthy"
    plain, _ = _run("none", precision, steps=50, watched=False)
    for (name, a), b in zip(watched.state_dict().items(), plain.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dividing_by_k_under_accelerator_backward_is_a_double_average(precision):
    _, watch = _run("double-average", precision)
    found = {f.kind: f for f in watch.findings}
    assert set(found) == {"double-average"}
    finding = found["double-average"]
    assert finding.severity == "error" and finding.rung == "watch"
    assert finding.location.line == marked_line(LOOP, "double-average")
    assert finding.evidence["measured"] == pytest.approx(1 / K, rel=0.01)
    assert finding.evidence["framework"] == "accelerate"
    assert "accelerator.backward" in finding.fix           # said in accelerate's terms
    assert watch.record["verdict"] == "failed"


@pytest.mark.parametrize("bug", ["missing-accumulation-average",
                                 "zero-grad-inside-accumulation", "scheduler-per-microbatch"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_classic_bug_is_named_at_its_line(bug, precision):
    _, watch = _run(bug, precision)
    found = {f.kind: f for f in watch.findings}
    assert set(found) == {bug}, found
    assert found[bug].severity == "error"
    assert found[bug].location.line == marked_line(LOOP, bug)
    if bug == "missing-accumulation-average":
        assert found[bug].evidence["measured"] == pytest.approx(K, rel=0.01)


def test_the_prepared_wrappers_are_seen_through():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=3, cpu=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, popt, psched = accelerator.prepare(model, opt, sched)
    watch = ampdoctor.watch_accelerate(accelerator, model, popt, scheduler=psched)
    assert watch.optimizer is opt and watch.scheduler is sched and watch.K == 3
    with pytest.raises(TypeError, match="Accelerator"):
        ampdoctor.watch_accelerate(model, model, popt)


def test_the_framework_names_are_lazy():
    """`import ampdoctor` and `ampdoctor.watch_accelerate` import neither accelerate nor
    transformers (only `ampdoctor.WatchCallback` imports transformers: it subclasses its
    TrainerCallback)."""
    import subprocess
    code = ("import sys, ampdoctor; ampdoctor.watch_accelerate; "
            "print(sorted(m for m in ('accelerate', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["[]"]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="accelerate builds its GradScaler only on a GPU: fp16 on a CPU "
                                 "has no loss scale to clip under or to skip with")


@CUDA
def test_fp16_on_a_gpu_a_healthy_loop_is_silent():
    _, watch = _run("none", "fp16", device="cuda")
    assert watch.record["verdict"] == "healthy" and watch.findings == []


@CUDA
def test_fp16_on_a_gpu_a_clip_past_accelerate_clips_scaled_gradients():
    _, watch = _run("clip-before-unscale", "fp16", device="cuda")
    found = {f.kind: f for f in watch.findings}
    assert "clip-before-unscale" in found, found
    assert found["clip-before-unscale"].location.line == marked_line(LOOP, "clip-before-unscale")


@CUDA
def test_fp16_on_a_gpu_a_scale_that_keeps_overflowing_is_frequent_skips():
    _, watch = _run("frequent-skips", "fp16", device="cuda", steps=24)
    found = {f.kind: f for f in watch.findings}
    assert "frequent-skips" in found, found
    assert found["frequent-skips"].severity == "error"
