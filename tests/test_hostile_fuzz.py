"""Mangled specs and records (hypothesis): every one is either accepted or refused with a clear
ampdoctor error naming what is wrong -- never another exception, never a crash in a renderer --
and every exit path of a diagnose leaves torch, sys.path and sys.modules as they were."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from ampdoctor import record as records
from ampdoctor.core.errors import SpecError, UsageError, UserCodeError
from ampdoctor.report.html import render_html
from ampdoctor.report.terminal import render
from ampdoctor.spec import load_spec
from conftest import CONFIGS, RECIPES

VALID_SPEC = yaml.safe_load((CONFIGS / "healthy_sgd.yaml").read_text())
VALID_SPEC["project_root"] = str(RECIPES)
VALID_SPEC["scan"] = {"paths": [str(RECIPES / "healthy_sgd.py")]}

VALID_RECORD = {
    "record_version": 1, "ampdoctor_version": "0.1.0", "spec": "/x/spec.yaml", "name": "run",
    "device": "cpu", "accumulation_steps": 4, "optimizer_steps": 3, "verdict": "failed",
    "failed_rung": "fp32-accum", "notes": ["a note"], "error": None,
    "rungs": [{"id": "fp32-accum", "status": "fail", "summary": "s", "seconds": 0.1,
               "findings": [], "details": {"max_relative_error": 3.0}}],
    "findings": [{"rung": "fp32-accum", "kind": "missing-accumulation-average",
                  "severity": "error", "message": "m", "title": "t", "fix": "f",
                  "evidence": {"measured": 4.0, "expected": 1.0},
                  "location": {"file": "/x/train.py", "line": 12, "code": "loss.backward()"}}],
    "series": {"scale": [65536.0, 32768.0], "skipped": [False, True],
               "grad_norm_before_unscale": [1.0], "grad_norm_after_unscale": [None]},
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12)


def _paths(value, prefix=()):
    """Every path into a nested dict/list value."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _mutate(base, data):
    """Replace, delete or add at a random path of a copy of `base`."""
    value = json.loads(json.dumps(base))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(value) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = value
        for part in path[:-1]:
            parent = parent[part]
        if not isinstance(parent, (dict, list)):
            continue
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        key = path[-1]
        try:
            if action == "replace":
                parent[key] = data.draw(json_values)
            elif action == "delete":
                del parent[key]
            elif isinstance(parent, dict):
                parent[data.draw(st.text(max_size=12))] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue
    return value


COUNTS = {"specs": 0, "records": 0}

# the count at the end reads COUNTS in this process: the module's tests stay on one xdist worker
pytestmark = pytest.mark.xdist_group("test_hostile_fuzz")
#: hundreds of generated inputs (each record rendered as terminal text and an HTML page)
many_runs = pytest.mark.slow


@many_runs
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_mangled_spec_is_accepted_or_refused_clearly(tmp_path_factory, data):
    spec = _mutate(VALID_SPEC, data)
    as_yaml = data.draw(st.booleans())
    text = yaml.safe_dump(spec, allow_unicode=True) if as_yaml else json.dumps(spec)
    if data.draw(st.booleans()):   # a raw edit of the text: a stray character somewhere
        at = data.draw(st.integers(0, len(text)))
        stray = data.draw(st.sampled_from([":", "-", "'", "\t", "[", "&a", "*a", "\x00"]))
        text = text[:at] + stray + text[at:]
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(text)
    COUNTS["specs"] += 1
    try:
        load_spec(path)
    except SpecError as exc:
        assert exc.exit_code == 2
        assert str(path.name) in exc.message or "spec key" in exc.message, exc.message
        assert len(exc.message) < 20_000


@many_runs
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_mangled_record_is_rendered_or_refused_clearly(tmp_path_factory, data):
    record = _mutate(VALID_RECORD, data)
    path = tmp_path_factory.mktemp("rec") / "record.json"
    path.write_text(json.dumps(record, allow_nan=True))
    COUNTS["records"] += 1
    try:
        loaded = records.load(path)
    except UsageError as exc:
        assert exc.exit_code == 2
        assert "record" in exc.message
        return
    render(loaded, Console(file=io.StringIO(), width=100))
    assert "<html" in render_html(loaded)
    assert records.exit_code(loaded) in (0, 1, 2, 3)


# ------------------------------------------------ every exit path restores what it changed
LEAVING = '''
import sys
import torch


def make():
    return torch.nn.Linear(4, 1)


def data():
    return torch.randn(16, 4), torch.randn(16, 1)


def ctrl_c(model, optimizer, micro_batches, run):
    raise KeyboardInterrupt


def exits(model, optimizer, micro_batches, run):
    sys.exit(0)


def hangs(model, optimizer, micro_batches, run):
    while True:
        pass
'''


def _state():
    import torch
    return (torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler.step,
            torch.optim.Optimizer.zero_grad, torch.autocast.__enter__, torch.nn.Module.__init__,
            torch.get_default_dtype(), list(sys.path), os._exit)


def _user_modules(root: Path) -> set[str]:
    return {name for name, module in list(sys.modules.items())
            if str(root) in (getattr(module, "__file__", None) or "")}


@pytest.mark.parametrize("loop, outcome", [("ctrl_c", KeyboardInterrupt),
                                           ("exits", UserCodeError), ("hangs", "error")])
def test_every_exit_path_leaves_torch_and_the_interpreter_as_they_were(tmp_path, loop, outcome):
    from ampdoctor.probe import recorder
    from ampdoctor.runner import run_diagnose

    (tmp_path / "leaving_mod.py").write_text(LEAVING)
    path = tmp_path / "spec.yaml"
    path.write_text("project_root: .\nmodel: leaving_mod:make\ndata: leaving_mod:data\n"
                    f"train_loop: leaving_mod:{loop}\naccumulation_steps: 2\n"
                    "micro_batch_size: 4\noptimizer_steps: 2\ndevice: cpu\n"
                    f"timeout_s: {2 if loop == 'hangs' else 120}\n")
    spec = load_spec(path)
    before = _state()
    if not isinstance(outcome, str):
        with pytest.raises(outcome):
            run_diagnose(spec)
    else:
        record = run_diagnose(spec)
        assert record.verdict == outcome
    assert _state() == before
    assert recorder.ACTIVE is None
    assert _user_modules(tmp_path) == set()


@many_runs      # with the two fuzz tests it counts
def test_the_fuzz_suite_counts(capsys):
    """Runs last in this module: how many mangled inputs were tried (all behaved, or a test
    above failed)."""
    with capsys.disabled():
        print(f"\nhostile fuzz: {COUNTS['specs']} mangled specs, {COUNTS['records']} mangled "
              "records, all accepted or refused with a clear error")
    assert COUNTS["specs"] >= 100 and COUNTS["records"] >= 100
