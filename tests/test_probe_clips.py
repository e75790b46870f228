"""Every public clipping path of torch is one Clip event: clip_grad_norm_, clip_grad_value_,
and the two-step get_total_norm + clip_grads_with_norm_ (torch >= 2.6, HuggingFace accelerate's
path when torch.distributed is available)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ampdoctor.probe import patches, recorder, wrappers
from ampdoctor.probe.callsite import CallSiteFinder
from ampdoctor.probe.events import Clip

needs_two_step = pytest.mark.skipif(not hasattr(torch.nn.utils, "clip_grads_with_norm_"),
                                    reason="torch < 2.6 has no get_total_norm / "
                                           "clip_grads_with_norm_")


def _params():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    return params


def _clips(run):
    """The Clip events `run()` records under an active probe with torch patched."""
    probe = recorder.Probe(CallSiteFinder([Path(__file__).parent]))
    with patches.installed(wrappers.install):
        previous = recorder.activate(probe)
        try:
            run()
        finally:
            recorder.activate(previous)
    return [e for e in probe.events if isinstance(e, Clip)]


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line)


def test_clip_grad_norm_is_recorded_once():
    params = _params()
    clips = _clips(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=3.0))
    assert len(clips) == 1
    clip = clips[0]
    assert (clip.clip_kind, clip.max_norm, clip.norm_type) == ("norm", 1.0, 3.0)
    assert clip.param_ids == tuple(id(p) for p in params)
    assert clip.total_norm is not None and clip.total_norm > 1.0


@needs_two_step
@pytest.mark.parametrize("module", ["torch.nn.utils", "torch.nn.utils.clip_grad"])
def test_the_two_step_clip_is_one_clip_like_clip_grad_norm_(module):
    utils = torch.nn.utils if module == "torch.nn.utils" else torch.nn.utils.clip_grad
    if not hasattr(utils, "clip_grads_with_norm_"):
        pytest.skip(f"{module} has no public clip_grads_with_norm_ in this torch")
    params = _params()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in params], math.inf))

    def two_step():
        total = utils.get_total_norm([p.grad for p in params], math.inf)
        utils.clip_grads_with_norm_(params, 0.5, total)  # the two-step clip

    clips = _clips(two_step)
    assert len(clips) == 1
    clip = clips[0]
    assert (clip.clip_kind, clip.max_norm, clip.norm_type) == ("norm", 0.5, math.inf)
    assert clip.param_ids == tuple(id(p) for p in params)
    assert clip.total_norm == pytest.approx(expected)
    assert clip.site is not None and clip.site.line == _line_of("# the two-step clip")
    assert float(torch.nn.utils.get_total_norm([p.grad for p in params], math.inf)) \
        == pytest.approx(0.5, rel=1e-4)


@needs_two_step
def test_a_total_norm_not_seen_computed_is_a_2_norm():
    params = _params()
    total = torch.tensor(100.0)
    clips = _clips(lambda: torch.nn.utils.clip_grads_with_norm_(params, max_norm=1.0,
                                                                  total_norm=total))
    assert [(c.max_norm, c.norm_type, c.total_norm) for c in clips] == [(1.0, 2.0, 100.0)]


@needs_two_step
def test_a_norm_recomputed_over_the_same_gradients_gives_its_norm_type():
    params = _params()

    def two_step():
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=1.0)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, total.clone())

    assert [c.norm_type for c in _clips(two_step)] == [1.0]


def test_clip_grad_value_is_recorded_once():
    params = _params()
    clips = _clips(lambda: torch.nn.utils.clip_grad_value_(params, 0.1))
    assert [(c.clip_kind, c.max_norm) for c in clips] == [("value", 0.1)]
