"""Judging each step as it happens (`judge.StepJudge`) says exactly what judging after the run
says: the same verdict, rung, kinds, numbers and lines, on healthy and broken loops; and the
reference computed inside the loop's optimizer step leaves the loop as it was."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

import ampdoctor
from ampdoctor import session as session_module
from ampdoctor.probe.events import OptimizerStep

ROOT = Path(__file__).resolve().parents[1]


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _diagnose(monkeypatch, spec, as_it_runs: bool):
    """The record's verdict and findings, and how many step groups were judged as they ran."""
    monkeypatch.setattr(session_module, "JUDGE_AS_IT_RUNS", as_it_runs)
    judged = []
    original = session_module.Session.run_loop

    def run_loop(self, precision, **kwargs):
        trace = original(self, precision, **kwargs)
        if trace.step_observer is not None:
            judged.append(len(trace.step_observer.groups))
        return trace

    monkeypatch.setattr(session_module.Session, "run_loop", run_loop)
    record = ampdoctor.diagnose(spec, save=False)
    monkeypatch.setattr(session_module.Session, "run_loop", original)
    seen = {"verdict": record.verdict, "failed_rung": record.failed_rung,
            "rungs": [(r["id"], r["status"]) for r in record.data["rungs"]],
            "findings": [(f.rung, f.kind, f.severity, f.location and f.location.line,
                          _rounded(f.evidence)) for f in record.findings]}
    return seen, sum(judged)


@pytest.mark.parametrize("recipe", [
    "healthy_fetch_ahead_nanogpt",
    "healthy_yolo_ema_checkpoint",   # the loop deep-copies its model (and the probe's hooks)
    "healthy_clip_scaled_threshold",
    "healthy_fairseq_overflow_retry",
    "broken_missing_average",
    "broken_no_zero_grad",           # the rule reads the step before the bad one
    "broken_clip_before_unscale",    # the rules read the reference norm of a window
    "broken_step_bypasses_scaler",   # the loop raised: the ratio of a step judged as it ran
    "broken_no_zero_grad_after_skip",
])
def test_as_it_runs_and_after_the_run_say_the_same(monkeypatch, recipe):
    spec = ROOT / "sample_configs" / f"{recipe}.yaml"
    now, groups = _diagnose(monkeypatch, spec, True)
    after, none = _diagnose(monkeypatch, spec, False)
    assert groups > 0 and none == 0   # the first really judged steps as they happened
    assert now == after
    assert now["verdict"] == ("healthy" if recipe.startswith("healthy") else "failed")


LOOP = textwrap.dedent('''\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    DRAWS = []
    AUTOCASTS = []


    def make_model():
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))


    def make_data():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 6, generator=g)
        return x, x[:, :1] - x[:, 1:2]


    def mse(model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)


    def train_loop(model, optimizer, micro_batches, run):
        K = run.accumulation_steps
        scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
        for i, (x, y) in enumerate(micro_batches):
            with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                loss = F.mse_loss(model(x).float(), y) / K
                scaler.scale(loss).backward()
                if (i + 1) % K == 0:
                    # the step inside autocast and no_grad, as some loops do
                    with torch.no_grad():
                        scaler.step(optimizer)
                    AUTOCASTS.append(torch.is_autocast_enabled(run.device_type))
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
            # the loop's own random stream goes on after each step
            DRAWS.append(float(torch.rand(())))
    ''')


def test_the_reference_inside_the_step_leaves_the_loop_as_it_was(monkeypatch, tmp_path):
    """Computed in the optimizer's pre-hook, inside the loop's autocast and no_grad, with
    aligned dropout seeding every reference forward: the loop's random draws after each step,
    its autocast state and the record are those of a run judged after it ended."""
    import importlib
    import sys

    (tmp_path / "hostile_loop.py").write_text(LOOP)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("hostile_loop")
    spec = ampdoctor.Spec(model=module.make_model, data=module.make_data, loss=module.mse,
                          train_loop=module.train_loop, accumulation_steps=4,
                          micro_batch_size=4, optimizer_steps=3,
                          rungs=["fp32-accum", "bf16-no-scaler", "fp16-scaler"])
    runs = {}
    for as_it_runs in (True, False):
        module.DRAWS.clear()
        module.AUTOCASTS.clear()
        record, groups = _diagnose(monkeypatch, spec, as_it_runs)
        runs[as_it_runs] = (record, groups, list(module.DRAWS), list(module.AUTOCASTS))
    now, after = runs[True], runs[False]
    assert now[1] > 0 and after[1] == 0
    assert now[0] == after[0] and now[0]["verdict"] == "healthy"
    assert now[2] == after[2] and len(now[2]) >= 3 * 12   # three runs of 12 micro-batches
    # the loop's autocast was still on after the step in bf16 and fp16, off in fp32
    assert now[3] == after[3] and now[3] == [False] * 3 + [True] * 3 + [True] * 3
    sys.modules.pop("hostile_loop", None)


def test_what_torch_and_ampdoctor_import_during_a_run_is_never_forgotten():
    """A project root that holds its virtual environment holds torch: a second diagnose in the
    same process must not re-import what torch loaded lazily in the first (torch refuses to
    register its operator libraries twice)."""
    import os
    import sys

    import torch

    from ampdoctor.loading import usercode as loading

    kept = loading._installed_prefixes()
    assert os.path.realpath(torch.__file__).startswith(kept)
    assert os.path.realpath(loading.__file__).startswith(kept)
    assert not str(ROOT / "recipes" / "common.py").startswith(kept)
    # the interpreter's prefix is not among them: a project in it (a venv made in the project
    # root) still has its own modules forgotten
    assert not any(p == os.path.realpath(sys.prefix) + os.sep for p in kept)


def test_the_rules_read_the_same_norms_from_the_scalars_a_step_judged_as_it_ran_keeps(
        monkeypatch):
    """Without the weights of a step judged as it ran, the fp16 rules' reference norm of a
    window and consumed/reference ratio of a step come from the squared norms the judge kept:
    the numbers the kept weights give after the run."""
    from ampdoctor.ladder import amp
    from ampdoctor.rules import scale_state

    original = amp.violation_observations
    seen = {}

    def spy(session, trace, rung):
        seen[session_module.JUDGE_AS_IT_RUNS] = (
            trace.step_observer is not None and not trace.probe.snapshots,
            [scale_state._reference_norm(session, trace, w) for w in range(session.N)],
            [scale_state.step_ratio(session, trace, e) for e in trace.events_of(OptimizerStep)])
        return original(session, trace, rung)

    monkeypatch.setattr(amp, "violation_observations", spy)
    spec = ROOT / "sample_configs" / "healthy_clip_active.yaml"
    for as_it_runs in (True, False):
        _diagnose(monkeypatch, spec, as_it_runs)
    (scalars, norms_now, ratios_now), (copies, norms_after, ratios_after) = seen[True], seen[False]
    assert scalars and not copies
    assert len(norms_now) == len(ratios_now) == 3 and None not in norms_now + ratios_now
    assert norms_now == pytest.approx(norms_after, rel=1e-6)
    assert ratios_now == pytest.approx(ratios_after, rel=1e-6)
    # the clip bites in this loop: the consumed gradient is shorter than the reference
    assert all(n > 0 for n in norms_now) and all(0 < r < 1 for r in ratios_now)


@pytest.mark.parametrize("where", ["reference", "judge", "keep"])
def test_an_error_in_the_early_judge_never_reaches_the_loop(monkeypatch, where):
    """Whatever fails in ampdoctor's own work inside the optimizer's pre-hook (the reference,
    the comparison, deciding what to keep), the step falls back to copies judged after the run:
    the same verdict, never a loop error blamed on the user's code."""
    from ampdoctor.judge import live as judge_live
    from ampdoctor.judge import step as judge_step

    spec = ROOT / "sample_configs" / "broken_no_zero_grad.yaml"
    expected, _ = _diagnose(monkeypatch, spec, False)
    calls = {"n": 0}
    fail_at = 2   # at the fp32 run's second step, after its first was judged as it ran

    def broken(original):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise ValueError("ampdoctor's own bug")
            return original(*args, **kwargs)
        return wrapper

    if where == "reference":
        monkeypatch.setattr(judge_live, "outside_the_loop", broken(judge_live.outside_the_loop))
    elif where == "judge":
        monkeypatch.setattr(judge_step, "judge_one_step", broken(judge_step.judge_one_step))
    else:
        monkeypatch.setattr(judge_live, "JudgedGradients", broken(judge_live.JudgedGradients))
    seen, groups = _diagnose(monkeypatch, spec, True)
    assert calls["n"] >= fail_at and groups > 0
    assert seen == expected and seen["failed_rung"] == "fp32-accum"
    assert seen["findings"][0][1] == "missing-zero-grad"


TWO_OPTIMIZERS = textwrap.dedent('''\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    def make_model():
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


    def make_data():
        g = torch.Generator().manual_seed(2)
        x = torch.randn(64, 6, generator=g)
        return x, x[:, :1] - x[:, 1:2]


    def mse(model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)


    def train_loop(model, optimizer, micro_batches, run):
        # a second optimizer the loop builds itself, stepping the first layer again on the same
        # gradients (after the first optimizer changed the weights)
        extra = torch.optim.SGD(model[0].parameters(), lr=0.01)
        K = run.accumulation_steps
        for i, (x, y) in enumerate(micro_batches):
            (F.mse_loss(model(x), y) / K).backward()
            if (i + 1) % K == 0:
                optimizer.step()
                extra.step()
                optimizer.zero_grad(set_to_none=True)
    ''')


def test_a_second_optimizer_the_loop_builds_is_judged_like_after_the_run(monkeypatch,
                                                                           tmp_path):
    """The spec names one optimizer, the loop steps a second one on the same gradients: the
    group where it first steps is judged as it runs against the group's own weights (the
    reference is held until the group ends), the later groups after the run; the record is the
    one a run judged after it ended gives."""
    import importlib
    import sys

    (tmp_path / "two_optimizers.py").write_text(TWO_OPTIMIZERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("two_optimizers")
    spec = ampdoctor.Spec(model=module.make_model, data=module.make_data, loss=module.mse,
                          train_loop=module.train_loop, accumulation_steps=4,
                          micro_batch_size=4, optimizer_steps=3, rungs=["fp32-accum"])
    now, groups = _diagnose(monkeypatch, spec, True)
    after, none = _diagnose(monkeypatch, spec, False)
    assert groups == 1 and none == 0   # the first group only: a second optimizer was seen
    assert now == after and now["rungs"][1] == ("fp32-accum", "pass")
    sys.modules.pop("two_optimizers", None)
