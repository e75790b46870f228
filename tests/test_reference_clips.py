"""The reference clips the way the loop meant (reference.clips): the parameters each call
covered, its norm type or value clipping, the threshold intended in true-gradient space."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ampdoctor.probe.events import make_event
from ampdoctor.reference import clip_calls, clip_ops, norm_of, reference_norm


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
    clipped, coefficients = clip_ops({"a": grads[:3], "b": grads[3:]}, ["a", "b"], calls)
    assert torch.allclose(torch.cat([clipped["a"], clipped["b"]]),
                          torch.cat([a.grad, b.grad]), atol=1e-6)
    assert coefficients[0] < 1 and coefficients[1] is None


def test_apply_clips_inf_norm():
    p = torch.nn.Parameter(torch.zeros(5))
    grads = torch.tensor([0.1, -0.9, 0.3, 0.0, 0.4])
    p.grad = grads.clone()
    torch.nn.utils.clip_grad_norm_([p], 0.3, norm_type=math.inf)
    calls = clip_calls({1: "p"}, [_clip(0, 0.3, ids=(1,), norm_type=math.inf)], {1: 0}, set())
    clipped, _ = clip_ops({"p": grads}, ["p"], calls)
    assert torch.allclose(clipped["p"], p.grad, atol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clips_in_sequence_match_torch_parameter_by_parameter(norm_type):
    """The judge clips the reference parameter by parameter (`clip_ops`, no clipped copy of the
    model), as torch's clips would, in order: a value clip of one parameter, then a norm clip
    over all three measured on what the value clip left (a None gradient counts as zeros), then a
    second norm clip of one."""
    torch.manual_seed(1)
    grads = {"a": torch.randn(3) * 2, "b": torch.randn(2) * 5, "c": None}
    params = {n: torch.nn.Parameter(torch.zeros(k)) for n, k in (("a", 3), ("b", 2), ("c", 4))}
    for name, grad in grads.items():
        params[name].grad = None if grad is None else grad.clone()
    torch.nn.utils.clip_grad_value_([params["b"]], 0.5)
    total = float(torch.nn.utils.clip_grad_norm_(list(params.values()), 0.8,
                                                 norm_type=norm_type))
    last = float(torch.nn.utils.clip_grad_norm_([params["a"]], 0.1))
    names = {1: "a", 2: "b", 3: "c"}
    owner = {1: 0, 2: 0, 3: 0}
    calls = clip_calls(names, [_clip(0, 0.5, ids=(2,), kind="value"),
                               _clip(1, 0.8, ids=(1, 2, 3), norm_type=norm_type),
                               _clip(2, 0.1, ids=(1,))], owner, set())
    original = {n: g.clone() for n, g in grads.items() if g is not None}
    clipped, coefficients = clip_ops(grads, ["a", "b", "c"], calls)
    assert coefficients[0] is None
    assert coefficients[1:] == pytest.approx([min(1.0, 0.8 / (total + 1e-6)),
                                              min(1.0, 0.1 / (last + 1e-6))], rel=1e-5)
    assert coefficients[1] < 1 and coefficients[2] < 1
    assert clipped["c"] is None
    for name in ("a", "b"):
        assert torch.allclose(clipped[name], params[name].grad, rtol=1e-5, atol=1e-7), name
    # the reference itself is never clipped in place (the value clip did bite), and its
    # unclipped norm over a call's parameters counts each parameter once
    assert all(torch.equal(grads[n], original[n]) for n in original)
    assert float(grads["b"].abs().max()) > 0.5
    flat = torch.cat([grads["a"], grads["b"]])
    assert norm_of(grads, ["a", "b", "c"], norm_type) == pytest.approx(
        float(torch.linalg.vector_norm(flat, norm_type)), rel=1e-6)
    repeated = dataclasses.replace(calls[1], names=("a", "b", "a", "c"))
    assert reference_norm(grads, repeated) == pytest.approx(
        float(torch.linalg.vector_norm(flat, norm_type)), rel=1e-6)
