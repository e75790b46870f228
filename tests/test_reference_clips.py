"""The reference clips the way the loop meant (reference.clips): the parameters each call
covered, its norm type or value clipping, the threshold intended in true-gradient space."""

from __future__ import annotations

import math
import pytest
import torch

from ampdoctor.probe.events import make_event
from ampdoctor.reference import apply_clips, clip_calls


def _event(seq, event_kind, **fields):
    return make_event(event_kind, seq, **fields)


PARAMS = {1: "a", 2: "b"}
OWNER = {1: 0, 2: 0}
SIZES = {"a": 3, "b": 2}


def _clip(seq, max_norm, ids=(1, 2), kind="norm", norm_type=2.0, total=None):
    return _event(seq, "clip", clip_kind=kind, max_norm=max_norm, norm_type=norm_type,
                  param_ids=tuple(ids), total_norm=total)


def test_a_clip_after_unscale_means_its_threshold():
    events = [_event(0, "backward", scaled_by=1024.0),
              _event(1, "unscale", enabled=True, inside_step=False, optimizer=0),
              _clip(2, 1.0)]
    [call] = clip_calls(PARAMS, events, OWNER, {1.0})
    assert call.scale is None and call.intended == 1.0 and not call.scaled_threshold


def test_a_scaled_threshold_on_scaled_gradients_means_the_true_threshold():
    events = [_event(0, "backward", scaled_by=1024.0), _clip(1, 1024.0 * 0.5, total=2048.0)]
    [call] = clip_calls(PARAMS, events, OWNER, {0.5})
    assert call.scale == 1024.0 and call.scaled_threshold
    assert call.intended == pytest.approx(0.5)
    assert call.seen_true_norm == pytest.approx(2.0) and call.bit


def test_a_plain_threshold_on_scaled_gradients_is_referenced_in_true_space():
    """A clip before unscale_ at max_norm is referenced at max_norm in true space, never at its
    effective threshold max_norm / S (it would then match itself)."""
    events = [_event(0, "backward", scaled_by=1024.0), _clip(1, 0.5, total=2048.0)]
    [call] = clip_calls(PARAMS, events, OWNER, {0.5})
    assert call.scale == 1024.0 and not call.scaled_threshold and call.intended == 0.5


def test_only_the_last_attempt_after_update_counts():
    events = [_event(0, "backward", scaled_by=8.0), _clip(1, 8.0), _event(2, "update"),
              _event(3, "backward", scaled_by=4.0), _clip(4, 4.0)]
    [call] = clip_calls(PARAMS, events, OWNER, {1.0})
    assert call.scale == 4.0 and call.intended == 1.0


def test_apply_clips_matches_torch_per_group_and_by_value():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    grads = torch.randn(5) * 3
    a.grad, b.grad = grads[:3].clone(), grads[3:].clone()
    torch.nn.utils.clip_grad_norm_([a], 0.7)
    torch.nn.utils.clip_grad_value_([b], 0.2)
    calls = clip_calls(PARAMS, [_clip(0, 0.7, ids=(1,)), _clip(1, 0.2, ids=(2,), kind="value")],
                       OWNER, set())
    clipped, coefficients = apply_clips(grads, ["a", "b"], SIZES, calls)
    assert torch.allclose(clipped, torch.cat([a.grad, b.grad]), atol=1e-6)
    assert coefficients[0] < 1 and coefficients[1] is None


def test_apply_clips_inf_norm():
    p = torch.nn.Parameter(torch.zeros(5))
    grads = torch.tensor([0.1, -0.9, 0.3, 0.0, 0.4])
    p.grad = grads.clone()
    torch.nn.utils.clip_grad_norm_([p], 0.3, norm_type=math.inf)
    calls = clip_calls({1: "p"}, [_clip(0, 0.3, ids=(1,), norm_type=math.inf)], {1: 0}, set())
    clipped, _ = apply_clips(grads, ["p"], {"p": 5}, calls)
    assert torch.allclose(clipped, p.grad, atol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clipping_tensor_by_tensor_equals_clipping_the_flat_vector(norm_type):
    """The judge clips the reference parameter by parameter (`clip_ops`, no clipped copy of the
    model): in order, a value clip of one parameter, then a norm clip over both measured on what
    the value clip left, then a second norm clip of one; a None gradient is zeros."""
    from ampdoctor.reference import clip_ops, norm_of

    torch.manual_seed(1)
    grads = {"a": torch.randn(3) * 2, "b": torch.randn(2) * 5, "c": None}
    sizes = {"a": 3, "b": 2, "c": 4}
    flat = torch.cat([grads["a"], grads["b"], torch.zeros(4)])
    names = {1: "a", 2: "b", 3: "c"}
    owner = {1: 0, 2: 0, 3: 0}
    calls = clip_calls(names, [_clip(0, 0.5, ids=(2,), kind="value"),
                               _clip(1, 0.8, ids=(1, 2, 3), norm_type=norm_type),
                               _clip(2, 0.1, ids=(1,))], owner, set())
    expected, coefficients = apply_clips(flat, ["a", "b", "c"], sizes, calls)
    clipped, lazy_coefficients = clip_ops(grads, ["a", "b", "c"], calls)
    assert coefficients[0] is None and lazy_coefficients[0] is None
    assert lazy_coefficients[1:] == pytest.approx(coefficients[1:], rel=1e-6)
    assert coefficients[1] < 1 and coefficients[2] < 1
    got = torch.cat([clipped["a"], clipped["b"], torch.zeros(4)])
    assert clipped["c"] is None and torch.allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(grads["a"], flat[:3])   # the reference itself is never clipped in place
    assert norm_of(grads, ["a", "b", "c"], norm_type) == pytest.approx(
        float(torch.linalg.vector_norm(flat, norm_type)), rel=1e-6)
