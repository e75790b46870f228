"""Memory and pass economy of a diagnose (issue 14): behaviour, not timings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ampdoctor import compare
from ampdoctor.probe import spill

ROOT = Path(__file__).resolve().parents[1]


def test_spilled_copies_read_back_exactly_and_keep_their_keys(monkeypatch):
    monkeypatch.setattr(spill, "SPILL_BYTES", 0)
    tensors = {"a.weight": torch.randn(3, 4), "a.bias": None, "b": torch.arange(5.0)}
    kept = spill.maybe_spill(tensors)
    assert isinstance(kept, spill.Spilled)
    assert list(kept) == list(tensors) and "a.bias" in kept and len(kept) == 3
    assert kept["a.bias"] is None and torch.equal(kept["a.weight"], tensors["a.weight"])
    assert dict(kept).keys() == tensors.keys()
    path = kept.path
    kept.release()
    assert not Path(path).exists()


def test_small_copies_stay_in_memory():
    tensors = {"w": torch.zeros(10)}
    assert spill.maybe_spill(tensors) is tensors


def test_chunked_metrics_match_the_whole_vector_ones(monkeypatch):
    user, ref = torch.randn(10_001), torch.randn(10_001)
    tol = compare.DEFAULT_TOLERANCES["fp32"]
    whole = compare.metrics(user, ref, tol)
    monkeypatch.setattr(compare, "CHUNK", 1000)
    chunked = compare.metrics(user, ref, tol)
    for field in ("rel_err", "ratio", "cosine", "norm_user", "norm_ref", "allowed"):
        assert getattr(chunked, field) == pytest.approx(getattr(whole, field), rel=1e-12)
    assert chunked.ok == whole.ok
    bad = user.clone()
    bad[5] = float("inf")
    assert not compare.metrics(bad, ref, tol).ok


def test_a_healthy_diagnose_reuses_the_first_reference_and_streams_the_second_fp32_run(
        monkeypatch):
    import ampdoctor
    from ampdoctor import session as session_module

    monkeypatch.setenv("AMPDOCTOR_COUNT_PASSES", "1")
    kept: list = []
    original = session_module.Session.run_loop

    def run_loop(self, precision, **kwargs):
        trace = original(self, precision, **kwargs)
        kept.append((kwargs.get("step_sink") is not None, trace))
        return trace

    monkeypatch.setattr(session_module.Session, "run_loop", run_loop)
    result = ampdoctor.diagnose(ROOT / "sample_configs" / "healthy_sgd.yaml")
    assert result.healthy
    rungs = {r["id"]: r for r in result.data["rungs"]}
    K, N = result.data["accumulation_steps"], result.data["optimizer_steps"]
    passes = rungs["fp32-accum"]["details"]["passes"]
    # the window-0 reference at the initial weights comes from the reproducibility rung
    assert sum(passes.values()) < N * K
    streamed = [trace for sink, trace in kept if sink]
    assert streamed, "the reproducibility rung's second fp32 run compares as it goes"
    for trace in streamed:
        assert trace.steps and all(not step.grads for step in trace.steps)
        assert not trace.probe.snapshots
