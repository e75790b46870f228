"""Which GradScaler owned which loss and optimizer (`rules.scaler_ownership`): two scalers are
a double scaling only when they meet on one loss or one optimizer's gradients. The events are
the probe's own dataclasses, in the order a loop would produce them."""

from __future__ import annotations

from ampdoctor.probe.callsite import Site
from ampdoctor.probe.events import Scale, ScalerInit, ScalerStep, Unscale, Update, ZeroGrad
from ampdoctor.rules.scaler_ownership import ownership

G_PARAMS, D_PARAMS = (101, 102), (201, 202)
OWNER = {101: 0, 102: 0, 201: 1, 202: 1}      # id(param) -> optimizer slot (G: 0, D: 1)


class Run:
    def __init__(self):
        self.events = []

    def add(self, cls, **fields):
        self.events.append(cls(seq=len(self.events), microbatch=0, backwards=0,
                               site=fields.pop("site", None), **fields))
        return self

    def init(self, slot, line):
        return self.add(ScalerInit, scaler=slot, enabled=True, site=Site("/t/gan.py", line, "f"))

    def scale(self, slot, reaches=None, already=None):
        return self.add(Scale, scaler=slot, scale=65536.0, enabled=True, reaches=reaches,
                        input_already_scaled=already)

    def step(self, slot, opt):
        self.add(ScalerStep, scaler=slot, optimizer=opt, scale=65536.0, enabled=True)
        self.add(Unscale, scaler=slot, optimizer=opt, scale=65536.0, enabled=True,
                 inside_step=True)
        return self.add(Update, scaler=slot)

    def zero(self, opt):
        return self.add(ZeroGrad, optimizer=opt, owner="optimizer")


def _gan(d_loss_reaches, g_loss_reaches, zero_between=False, windows=2):
    run = Run().init(0, 10).init(1, 11)
    for _ in range(windows):
        for _ in range(4):
            run.scale(1, d_loss_reaches).scale(0, g_loss_reaches)
        run.step(1, 1)
        if zero_between:
            run.zero(1)
        run.step(0, 0)
        run.zero(0).zero(1)
    return ownership(run.events, OWNER)


def test_a_gan_with_one_scaler_per_network_is_two_separate_machines():
    seen = _gan(D_PARAMS, G_PARAMS)
    assert seen.shared == []
    assert {s.slot: (s.stepped, s.reached, s.scaled) for s in seen.scalers.values()} == {
        0: ({0}, {0}, 8), 1: ({1}, {1}, 8)}
    assert seen.slots_at("/t/gan.py", 11) == [1]


def test_g_loss_reaching_d_gradients_that_d_steps_is_two_machines_on_one_optimizer():
    """No detach/freeze: G's scaled loss lands in D's accumulated gradients, which D's scaler
    unscales by its own scale."""
    seen = _gan(D_PARAMS, G_PARAMS + D_PARAMS)
    assert seen.shared == [{"how": "foreign-gradients", "scalers": [0, 1], "by": 1,
                            "optimizer": 1}]


def test_foreign_gradients_cleared_by_zero_grad_before_the_step_are_no_meeting():
    """DCGAN order: D steps, G's backward pollutes D's gradients, D's zero_grad clears them
    before D's scaler sees them again."""
    run = Run().init(0, 10).init(1, 11)
    for _ in range(3):
        run.scale(1, D_PARAMS).step(1, 1).zero(1)
        run.scale(0, G_PARAMS + D_PARAMS).step(0, 0).zero(0).zero(1)
    assert ownership(run.events, OWNER).shared == []


def test_an_aux_scaler_that_never_steps_meets_the_main_one_on_its_optimizer():
    run = Run().init(0, 50).init(1, 51)
    for _ in range(4):
        run.scale(0, G_PARAMS).scale(1, G_PARAMS)
    run.step(0, 0).zero(0)
    seen = ownership(run.events, OWNER)
    assert seen.shared == [{"how": "foreign-gradients", "scalers": [0, 1], "by": 0,
                            "optimizer": 0}]
    assert seen.scalers[1].stepped == set()


def test_two_scalers_stepping_one_optimizer_meet_there():
    run = Run().init(0, 10).init(1, 11).step(0, 0).step(1, 0)
    assert [m["how"] for m in ownership(run.events, OWNER).shared] == ["one-optimizer"]


def test_a_scale_of_a_scaled_loss_is_a_meeting():
    run = Run().init(0, 10).init(1, 11).scale(1, G_PARAMS, already=65536.0)
    assert ownership(run.events, OWNER).shared == [
        {"how": "scaled-twice", "scalers": [1], "by": 1, "optimizer": None}]


def test_losses_whose_graph_was_not_read_reach_what_the_read_ones_did():
    """The probe reads only a scaler's first losses; the later ones count as reaching the
    same optimizers."""
    run = Run().init(0, 50).init(1, 51).scale(0, G_PARAMS).scale(1, G_PARAMS)
    run.scale(0).scale(1).step(0, 0)
    seen = ownership(run.events, OWNER)
    assert seen.scalers[1].reached == {0}
    assert [m["how"] for m in seen.shared] == ["foreign-gradients"]
