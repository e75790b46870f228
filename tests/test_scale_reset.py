"""The loss-scale state machine restarted mid-run (`rules.skip_rate.scale_resets`), read from
the scale trajectory: one persistent GradScaler carries its scale from one update to the next;
a scaler that replaces it without its state starts again from its initial scale. Fed events,
as the probe records them."""

from __future__ import annotations

from ampdoctor.core.enums import Severity
from ampdoctor.probe.callsite import Site
from ampdoctor.probe.events import Event, Scale, ScalerInit, ScalerStep, Update
from ampdoctor.rules import skip_rate

SITE = Site("train.py", 12, "train_step")


class _Trace:
    def __init__(self, events: list[Event]):
        self.events = events

    def events_of(self, cls):
        return [e for e in self.events if isinstance(e, cls)]


class _Run:
    """Builds a run's scaler events in order."""

    def __init__(self):
        self.events: list[Event] = []

    def _add(self, cls, **fields):
        self.events.append(cls(seq=len(self.events), microbatch=0, backwards=0, site=SITE,
                               **fields))

    def build(self, scaler: int, enabled: bool = True):
        self._add(ScalerInit, scaler=scaler, enabled=enabled, init_scale=65536.0,
                  growth_interval=2000)
        return self

    def step(self, scaler: int, before: float, after: float):
        self._add(Scale, scaler=scaler, scale=before, enabled=True)
        self._add(ScalerStep, scaler=scaler, enabled=True, skipped=after < before)
        self._add(Update, scaler=scaler, scale_before=before, scale_after=after)
        return self

    def trace(self) -> _Trace:
        return _Trace(self.events)


def test_a_new_scaler_per_step_loses_the_backoff():
    run = (_Run().build(0).step(0, 65536, 65536).build(1).step(1, 65536, 32768)
           .build(2).step(2, 65536, 65536))
    [reset] = skip_rate.scale_resets(run.trace())
    assert (reset.reached, reset.restarted, reset.init.scaler) == (32768, 65536, 2)
    finding = skip_rate.scale_reset([("fp16 run", run.trace())], "skips")
    assert finding is not None
    assert (finding.kind, finding.severity) == ("frequent-skips", Severity.ERROR)
    assert (finding.location.file, finding.location.line) == ("train.py", 12)
    assert finding.evidence["scalers_built"] == 3 and finding.evidence["skipped"] == 1
    assert finding.evidence["scale"] == [65536, 32768, 65536]
    # in a run ampdoctor forced into fp16 (no scaler of the training's own), a warning
    forced = skip_rate.scale_reset([("fp16 run", run.trace())], "skips", own_scaler=False)
    assert forced is not None and forced.severity == Severity.WARNING


def test_one_scaler_or_a_restored_one_is_no_reset():
    one = _Run().build(0).step(0, 65536, 32768).step(0, 32768, 32768).step(0, 32768, 32768)
    # rebuilt every step with the previous state loaded (a resume): the scale carries over
    restored = (_Run().build(0).step(0, 65536, 32768).build(1).step(1, 32768, 16384)
                .build(2).step(2, 16384, 16384))
    # a new scaler per step whose scale never moved: nothing in the trajectory differs
    unmoved = _Run().build(0).step(0, 65536, 65536).build(1).step(1, 65536, 65536)
    for run in (one, restored, unmoved):
        assert skip_rate.scale_resets(run.trace()) == []
        assert skip_rate.scale_reset([("fp16 run", run.trace())], "skips") is None


def test_two_live_scalers_replace_nothing():
    """A GAN's two scalers, the second built after the first one's first update, both used on:
    neither replaced the other."""
    run = (_Run().build(0).step(0, 65536, 32768).build(1).step(1, 65536, 65536)
           .step(0, 32768, 32768).step(1, 65536, 65536))
    assert skip_rate.scale_resets(run.trace()) == []


def test_disabled_scalers_are_not_loss_scales():
    run = _Run().build(0).step(0, 65536, 32768).build(1, enabled=False).build(2, enabled=False)
    assert skip_rate.scale_resets(run.trace()) == []
