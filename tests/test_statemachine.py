"""The step state machine, driven with event sequences, legal and illegal."""

from __future__ import annotations

import pytest

from ampdoctor.probe.events import EVENT_TYPES, make_event
from ampdoctor.probe.statemachine import Illegal, StepStateMachine

P0, P1 = 100, 200   # param ids: P0 belongs to optimizer 0, P1 to optimizer 1


def ev(kind, optimizer=None, **fields):
    if optimizer is not None or "optimizer" in EVENT_TYPES[kind].__dataclass_fields__:
        fields["optimizer"] = optimizer
    if "param_ids" in fields:
        fields["param_ids"] = tuple(fields["param_ids"])
    return make_event(kind, **fields)


def scaled_backward():
    return [ev("scale", enabled=True, scale=65536.0), ev("backward", scaled_by=65536.0)]


def window(K=4, *, tail):
    events = []
    for _ in range(K):
        events += scaled_backward()
    return events + tail


GOOD_TAIL = [ev("unscale", 0, enabled=True), ev("clip", param_ids=[P0]),
             ev("scaler_step", 0), ev("step", 0, via_scaler=True), ev("update"), ev("zero_grad", 0)]


#: the kind each illegal transition is first read as (rules/scale_state.py's observations)
KIND_OF = {Illegal.SCALE_OF_SCALED: "double-scaling", Illegal.SECOND_UNSCALE: "unscale-twice",
           Illegal.CLIP_WHILE_SCALED: "clip-before-unscale",
           Illegal.STEP_WHILE_SCALED: "missing-unscale",
           Illegal.UPDATE_WITHOUT_STEP: "update-per-microbatch"}


def kinds(events):
    machine = StepStateMachine({P0: 0, P1: 1})
    return [KIND_OF[v.kind] for v in machine.feed_all(events)]


def test_correct_order_is_legal_over_several_windows():
    assert kinds(window(tail=GOOD_TAIL) * 3) == []


def test_two_optimizers_done_right_are_legal():
    tail = [ev("unscale", 0, enabled=True), ev("unscale", 1, enabled=True),
            ev("clip", param_ids=[P0, P1]), ev("scaler_step", 0), ev("step", 0, via_scaler=True),
            ev("scaler_step", 1), ev("step", 1, via_scaler=True), ev("update")]
    assert kinds(window(tail=tail) * 2) == []


def test_scaler_step_unscaling_for_you_is_legal():
    tail = [ev("scaler_step", 0), ev("unscale", 0, enabled=True, inside_step=True),
            ev("step", 0, via_scaler=True), ev("update")]
    assert kinds(window(tail=tail)) == []


def test_clip_before_unscale():
    tail = [ev("clip", param_ids=[P0]), ev("scaler_step", 0), ev("step", 0, via_scaler=True),
            ev("update")]
    assert kinds(window(tail=tail)) == ["clip-before-unscale"]


def test_clip_without_a_scaler_is_fine():
    events = [ev("backward")] * 4 + [ev("clip", param_ids=[P0]), ev("step", 0)]
    assert kinds(events) == []


def test_second_optimizer_stepped_directly_is_missing_unscale():
    tail = [ev("unscale", 0, enabled=True), ev("scaler_step", 0), ev("step", 0, via_scaler=True),
            ev("step", 1, via_scaler=False), ev("update")]
    assert kinds(window(tail=tail)) == ["missing-unscale"]


def test_unscale_twice():
    tail = [ev("unscale", 0, enabled=True), ev("unscale", 0, enabled=True), ev("scaler_step", 0),
            ev("update")]
    assert kinds(window(tail=tail)) == ["unscale-twice"]


def test_update_without_step_is_update_per_microbatch():
    events = scaled_backward() + [ev("update")] + window(tail=GOOD_TAIL)
    assert kinds(events) == ["update-per-microbatch"]


def test_scale_of_scaled_tensor_is_double_scaling():
    events = [ev("scale", enabled=True, scale=65536.0, input_already_scaled=65536.0)]
    assert kinds(events) == ["double-scaling"]


@pytest.mark.parametrize("K", [1, 2, 8])
def test_any_K_is_legal(K):
    assert kinds(window(K, tail=GOOD_TAIL)) == []


def test_clipping_a_second_optimizers_params_before_its_unscale():
    # optimizer 0 unscaled, but the clip also covers optimizer 1's still-scaled gradients
    tail = [ev("unscale", 0, enabled=True), ev("clip", param_ids=[P0, P1]),
            ev("unscale", 1, enabled=True), ev("scaler_step", 0), ev("scaler_step", 1),
            ev("update")]
    assert kinds(window(tail=tail)) == ["clip-before-unscale"]
