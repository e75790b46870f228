"""Script mode: random draws inside the model's forward take their expected values
(`script.expectation`), so a reference run over the whole window (one forward of K x b rows)
sees the same forward as the run's K micro-batches. Unit tests of the replaced draws, and the
real CLI on a vision-transformer script with stochastic depth (two draws per block: a false
weighted-average-mismatch before), healthy and broken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ampdoctor.probe import patches
from ampdoctor.probe.callsite import CallSiteFinder
from ampdoctor.script import expectation
from conftest import RECIPES, marked_line, run_cli

VIT = RECIPES / "scripts" / "vit_stochastic_depth.py"


class Drawing(torch.nn.Module):
    """A forward that draws in every way the expectation replaces, and returns the draws."""

    def forward(self, x):
        return {
            "bernoulli_": x.new_empty(x.shape[0], 1).bernoulli_(0.8),
            "bernoulli_bool": torch.empty(3, dtype=torch.bool).bernoulli_(0.8),
            "bernoulli_int_low": torch.empty(3, dtype=torch.int64).bernoulli_(0.3),
            "bernoulli": torch.bernoulli(torch.full((2, 2), 0.3)),
            "rand": torch.rand(2, 3),
            "rand_tuple": torch.rand((2, 3), dtype=torch.float64),
            "randn": torch.randn(4),
            "rand_like": torch.rand_like(x),
            "randn_like": torch.randn_like(x),
            "uniform_": torch.empty(3).uniform_(-1.0, 3.0),
            "normal_": torch.empty(3).normal_(2.0, 5.0),
            "randperm": torch.randperm(5),
        }


@pytest.fixture
def installed():
    state = expectation.Expectation(CallSiteFinder([Path(__file__).parent]))
    with patches.installed(lambda p: expectation.install(state, p)):
        yield state
    assert torch.rand is not None


def test_draws_in_the_forward_take_their_expected_values(installed):
    model = Drawing()
    installed.track(model)
    x = torch.ones(4, 2)
    before = torch.get_rng_state()
    out = model(x)
    assert torch.equal(torch.get_rng_state(), before)      # the generator was not touched
    assert torch.equal(out["bernoulli_"], torch.full((4, 1), 0.8))
    assert out["bernoulli_bool"].all()                      # keep (p >= 0.5)
    assert not out["bernoulli_int_low"].any()               # drop (p < 0.5)
    assert torch.equal(out["bernoulli"], torch.full((2, 2), 0.3))
    assert torch.equal(out["rand"], torch.full((2, 3), 0.5))
    assert out["rand_tuple"].dtype == torch.float64 and out["rand_tuple"].shape == (2, 3)
    assert torch.equal(out["randn"], torch.zeros(4))
    assert torch.equal(out["rand_like"], torch.full_like(x, 0.5))
    assert torch.equal(out["randn_like"], torch.zeros_like(x))
    assert torch.equal(out["uniform_"], torch.full((3,), 1.0))   # (-1 + 3) / 2
    assert torch.equal(out["normal_"], torch.full((3,), 2.0))
    assert torch.equal(out["randperm"], torch.arange(5))
    assert installed.count == 12
    assert installed.sites[0].startswith("test_script_expectation.py:")


def test_draws_outside_the_forward_or_without_grad_stay_random(installed):
    model = Drawing()
    installed.track(model)
    torch.manual_seed(0)
    outside = torch.rand(1000)
    with torch.no_grad():
        evaluated = model(torch.ones(4, 2))
    assert installed.count == 0
    assert 0.4 < float(outside.mean()) < 0.6 and float(outside.std()) > 0.2
    assert float(evaluated["rand"].std()) > 0            # an eval forward draws as usual


def test_a_forward_that_raises_ends_its_depth(installed):
    class Failing(torch.nn.Module):
        def forward(self, x):
            raise ValueError("bad batch")

    model = Failing()
    installed.track(model)
    with pytest.raises(ValueError):
        model(torch.ones(1))
    assert installed.depth == 0
    assert float(torch.rand(1000).std()) > 0.2          # outside the forward again


def test_every_patch_is_undone():
    originals = {name: getattr(owner, name) for owner, name, _ in expectation._REPLACED}
    state = expectation.Expectation(CallSiteFinder())
    with patches.installed(lambda p: expectation.install(state, p)):
        assert torch.rand is not originals["rand"]
    for owner, name, _ in expectation._REPLACED:
        assert getattr(owner, name) is originals[name]




@pytest.mark.xdist_group("script_mode")
def test_stochastic_depth_script_is_healthy_and_says_what_it_fixed(tmp_path):
    result = run_cli("diagnose", VIT, "--json", "--out", tmp_path / "runs")
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert record["reference_args_origin"] == "inferred"
    compared = {r["id"]: r["status"] for r in record["rungs"]}
    assert compared["fp32-accum"] == "pass" and compared["fp16-scaler"] == "pass"
    note = next(n for n in record["notes"] if "expected values" in n)
    line = next(i for i, text in enumerate(VIT.read_text().splitlines(), start=1)
                if text.strip().startswith("random_tensor = "))
    assert f"vit_stochastic_depth.py:{line} bernoulli_" in note


@pytest.mark.xdist_group("script_mode")
def test_stochastic_depth_script_without_the_division_is_named(tmp_path):
    result = run_cli("diagnose", VIT, "--json", "--out", tmp_path / "runs", "--",
                     "--bug", "no-average")
    assert result.returncode == 1, result.stderr
    found = next(f for f in result.record["findings"] if f["severity"] == "error")
    assert (found["rung"], found["kind"]) == ("fp32-accum", "missing-accumulation-average")
    assert found["location"]["line"] == marked_line(VIT, "missing-accumulation-average")
    assert found["evidence"]["measured"] == pytest.approx(4.0, rel=1e-3)   # K = 4
