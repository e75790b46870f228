"""Memory and pass economy of a diagnose (issue 14): behaviour, not timings."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ampdoctor.judge import JudgedGradients
from ampdoctor.maths import compare
from ampdoctor.probe import spill

ROOT = Path(__file__).resolve().parents[1]


def test_spilled_copies_read_back_exactly_and_keep_their_keys(monkeypatch):
    monkeypatch.setattr(spill, "SPILL_BYTES", 0)
    monkeypatch.setattr(spill, "KEEP_IN_MEMORY", 0)
    tensors = {"a.weight": torch.randn(3, 4), "a.bias": None, "b": torch.arange(5.0)}
    kept = spill.maybe_spill(tensors)
    assert isinstance(kept, spill.Spilled)
    assert list(kept) == list(tensors) and "a.bias" in kept and len(kept) == 3
    assert kept["a.bias"] is None and torch.equal(kept["a.weight"], tensors["a.weight"])
    assert dict(kept).keys() == tensors.keys()
    path = kept.path
    kept.release()
    assert not Path(path).exists()


def test_at_most_keep_in_memory_large_copies_stay_in_memory(monkeypatch):
    import gc

    monkeypatch.setattr(spill, "SPILL_BYTES", 0)
    monkeypatch.setattr(spill, "KEEP_IN_MEMORY", 2)
    gc.collect()
    monkeypatch.setattr(spill, "_KEPT", 0)   # restored when the test ends
    first = spill.maybe_spill({"w": torch.ones(3)})
    second = spill.maybe_spill({"w": torch.ones(3) * 2})
    third = spill.maybe_spill({"w": torch.ones(3) * 3})
    assert not isinstance(first, spill.Spilled) and not isinstance(second, spill.Spilled)
    assert isinstance(third, spill.Spilled)
    assert torch.equal(third["w"], torch.ones(3) * 3) and torch.equal(second["w"], 2 * first["w"])
    del first   # one place free again
    fourth = spill.maybe_spill({"w": torch.ones(3)})
    assert not isinstance(fourth, spill.Spilled)
    third.release()
    del second, third, fourth
    gc.collect()
    assert spill._KEPT == 0


def test_small_copies_stay_in_memory():
    tensors = {"w": torch.zeros(10)}
    assert spill.maybe_spill(tensors) is tensors


def test_chunked_metrics_are_as_accurate_as_float64(monkeypatch):
    """Chunks reduced in float64: the float64 answer to 1e-10 at any chunk size, whatever the
    BLAS (a float32 dot of a 1M-element chunk is off by up to ~4e-6 on some CPUs)."""
    torch.manual_seed(0)
    user = torch.randn(2_000_003) * 1e-3
    ref = user + torch.randn(2_000_003) * 1e-6
    u, r = user.double(), ref.double()
    exact = {"norm_user": float(u.norm()), "norm_ref": float(r.norm()),
             "rel_err": float((u - r).norm() / r.norm()),
             "cosine": float(u @ r / (u.norm() * r.norm()))}
    tol = compare.DEFAULT_TOLERANCES["fp32"]
    for chunk in (compare.CHUNK, 1000):
        monkeypatch.setattr(compare, "CHUNK", chunk)
        m = compare.metrics(user, ref, tol)
        for field, value in exact.items():
            assert getattr(m, field) == pytest.approx(value, rel=1e-10), (chunk, field)
        assert m.ok
    assert compare.norm2(user) == pytest.approx(exact["norm_user"], rel=1e-10)
    # a long run of equal values: the case where a float32 running sum drifts most
    flat = torch.full((3_000_001,), 0.1)
    assert compare.sum_of_squares(flat) == pytest.approx(
        float(flat.double().pow(2).sum()), rel=1e-12)
    assert compare.sum_of_squares(flat.half()) == pytest.approx(
        float(flat.half().double().pow(2).sum()), rel=1e-12)
    bad = user.clone()
    bad[5] = float("inf")
    assert not compare.metrics(bad, ref, tol).ok
    assert not compare.all_finite(bad) and compare.all_finite(user)
    bad[5] = float("nan")
    assert not compare.metrics(bad, ref, tol).ok and not compare.all_finite(bad)
    # beyond float32's range: still finite, still measured
    huge = torch.full((10,), 1e30)
    assert compare.norm2(huge) == pytest.approx(math.sqrt(10) * 1e30, rel=1e-6)
    assert compare.all_finite(torch.empty(0))


@pytest.mark.parametrize("as_it_runs", [True, False], ids=["judged-as-it-runs", "judged-after"])
def test_a_healthy_diagnose_reuses_the_first_reference_and_streams_the_second_fp32_run(
        monkeypatch, as_it_runs):
    import ampdoctor
    from ampdoctor import session as session_module

    monkeypatch.setenv("AMPDOCTOR_COUNT_PASSES", "1")
    monkeypatch.setattr(session_module, "JUDGE_AS_IT_RUNS", as_it_runs)
    kept: list = []
    original = session_module.Session.run_loop

    firsts: list = []
    copied: dict = {}   # per run, as it returned: which steps' gradients were copied

    def run_loop(self, precision, **kwargs):
        trace = original(self, precision, **kwargs)
        kept.append((kwargs.get("step_sink") is not None, trace))
        copied[id(trace)] = [not isinstance(s.grads, JudgedGradients) for s in trace.steps]
        for step in trace.steps:
            if isinstance(step.grads, JudgedGradients):   # a gradient not kept is never zeros
                assert list(step.grads) == list(trace.steps[0].grads)
                with pytest.raises(RuntimeError, match="judged as they happened"):
                    step.grads.get(next(iter(step.grads)))
        if trace.probe.snapshots and kwargs.get("state") is None:
            first = trace.probe.snapshots[min(trace.probe.snapshots)]
            firsts.append(first.state is self.initial_state)
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
        # ... and stops after its first optimizer step: one window of passes, not N
        assert trace.stopped and trace.error is None and len(trace.steps) == 1
        assert trace.microbatches_taken == K
    judged = [trace for sink, trace in kept if not sink and trace.step_observer is not None]
    if as_it_runs:
        # every run a rung judges was judged step by step: no weights kept, and of the
        # gradients only the fp32 run's first step and the last step (what a later step that
        # failed would have carried over)
        assert {t.precision for t in judged} == {"fp32", "bf16", "fp16"} and not firsts
        for trace in judged:
            assert not trace.probe.snapshots and not trace.step_observer.failed
            assert len(trace.step_observer.groups) == len(trace.steps) == N
            # as the run returned (rung_done has released every copy since)
            assert copied[id(trace)] == ([True] + [False] * (N - 2) + [True]
                                         if trace.precision == "fp32" else
                                         [False] * (N - 1) + [True])
    else:
        assert not judged
        # a run's first step saw the initial weights: its snapshot is them, not a copy
        assert firsts and all(firsts)
    repro = rungs["reproducibility"]["details"]["passes"]
    assert repro["loop"] == N * K + K
    # every finished run gave back its optimizer state, gradients and parameters' storage
    for _, trace in kept:
        model = trace.probe.model
        assert all(not opt.state for opt in trace.probe.optimizers)
        assert all(p.grad is None and p.untyped_storage().nbytes() == 0
                   for p in model.parameters())


def test_tensor_by_tensor_metrics_match_the_flat_ones():
    shapes = {"a": torch.Size([3, 4]), "b": torch.Size([2]), "c": torch.Size([5]),
              "d": torch.Size([1])}
    user = {"a": torch.randn(3, 4), "b": None, "c": torch.randn(5), "d": None}
    ref = {"a": torch.randn(3, 4), "b": torch.randn(2), "c": None, "d": None}
    tol = compare.DEFAULT_TOLERANCES["fp32"]
    names = list(shapes)
    flat = compare.metrics(compare.flatten(user, names, shapes),
                           compare.flatten(ref, names, shapes), tol)
    by_tensor = compare.metrics_of(user, ref, names, shapes, tol)
    for field in ("rel_err", "ratio", "cosine", "norm_user", "norm_ref", "allowed"):
        assert getattr(by_tensor, field) == pytest.approx(getattr(flat, field), rel=1e-6)
    same = compare.metrics_of(user, user, names, shapes, tol)
    assert same.ok and same.rel_err == 0


def test_freed_heap_pages_go_back_to_the_system():
    import ctypes.util
    import sys

    from ampdoctor.core import memory

    block = torch.ones(8 * 2**20 // 4)   # 8 MiB, freed below
    del block
    glibc = sys.platform == "linux" and hasattr(memory._libc() or object(), "malloc_trim")
    assert memory.trim() is glibc
    assert ctypes.util.find_library("c") is not None or not glibc


def _scaled_loop(model, optimizer, micro_batches, run):
    """Two windows; between them the scale is set by hand twice (update(new_scale) and
    load_state_dict), which the probe must see although it reads the scale once per update."""
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for i, (x, y) in enumerate(micro_batches):
        loss = torch.nn.functional.mse_loss(model(x), y) / 2
        scaler.scale(loss).backward()
        if i % 2 == 1:
            scaler.step(optimizer)
            scaler.update(new_scale=32.0 if i == 1 else None)
            optimizer.zero_grad()
        if i == 2:
            state = scaler.state_dict()
            state["scale"] = 8.0
            scaler.load_state_dict(state)


def test_the_scale_each_micro_batch_saw_is_recorded_without_a_read_per_micro_batch(
        monkeypatch):
    from ampdoctor.probe import patches, recorder, wrappers
    from ampdoctor.probe.callsite import CallSiteFinder

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mbs = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    reads = []
    original = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale",
                        lambda self: reads.append(1) or original(self))
    probe = recorder.Probe(CallSiteFinder([ROOT]), model, [optimizer])
    with patches.installed(wrappers.install):
        previous = recorder.activate(probe)
        try:
            _scaled_loop(model, optimizer, mbs, None)
        finally:
            recorder.activate(previous)
    scales = [e.scale for e in probe.events if e.kind == "scale"]
    assert scales == [256.0, 256.0, 32.0, 8.0]
    backwards = [e for e in probe.events if e.kind == "backward"]
    assert [e.scaled_by for e in backwards] == [256.0, 256.0, 32.0, 8.0]
    # the loss is read for the first backward only (the first scaled one is the same)
    assert backwards[0].value is not None and all(e.value is None for e in backwards[1:])
    assert len(reads) < 2 * len(mbs) + 6


def _findings(spec) -> dict:
    import ampdoctor
    record = ampdoctor.diagnose(spec, save=False)
    return {"verdict": record.verdict, "failed_rung": record.failed_rung,
            "rungs": [(r["id"], r["status"], r["summary"]) for r in record.data["rungs"]],
            "findings": [(f.rung, f.kind, f.location and f.location.line, f.evidence)
                         for f in record.findings]}


@pytest.mark.parametrize("recipe", ["broken_no_zero_grad", "healthy_clip_scaled_threshold"])
def test_copies_kept_for_long_go_to_disk_and_change_nothing(monkeypatch, recipe):
    """The reference reused at the initial weights and the fp32 run's first gradients (kept
    for the repeat run) are on disk when large; read back, every verdict, number and line is
    what the in-memory copies give (broken_no_zero_grad's rule reads the step before the bad
    one: the fp32 run's first, from disk)."""
    spec = ROOT / "sample_configs" / f"{recipe}.yaml"
    in_memory = _findings(spec)
    monkeypatch.setattr(spill, "SPILL_BYTES", 0)   # every copy counts as large
    reads: list[int] = []
    moved: list[int] = []
    read_fresh, to_disk = spill.Spilled.read_fresh, spill.to_disk
    monkeypatch.setattr(spill.Spilled, "read_fresh",
                        lambda self: reads.append(1) or read_fresh(self))
    monkeypatch.setattr(spill, "to_disk", lambda t: moved.append(1) or to_disk(t))
    on_disk = _findings(spec)
    assert reads and moved   # the reused reference was read back, the first gradients moved
    assert on_disk == in_memory
    assert in_memory["verdict"] == ("healthy" if recipe.startswith("healthy") else "failed")
