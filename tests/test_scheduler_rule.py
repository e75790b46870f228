"""scheduler-per-microbatch: judged per scheduler object by the learning rate each optimizer
step used against the schedule's value for that step, not by call counts alone."""

from __future__ import annotations

from types import SimpleNamespace

from ampdoctor.probe.events import make_event
from ampdoctor.rules import scheduler_findings


def _trace(events):
    seq = [make_event(e["kind"], i, optimizer=0, **e["data"]) for i, e in enumerate(events)]
    steps = [SimpleNamespace(group=i, seq=e.seq, optimizer=0)
             for i, e in enumerate(x for x in seq if x.kind == "step")]
    return SimpleNamespace(events=seq, steps=steps, precision="fp32", error=None,
                           events_of=lambda cls: [e for e in seq if isinstance(e, cls)])


def _schedule(pattern, obj=1, factor=0.5, lr=1.0):
    """`pattern` of "s" (scheduler.step) and "o" (optimizer.step); each scheduler step
    multiplies the LR by `factor`."""
    events = []
    for c in pattern:
        if c == "o":
            events.append({"kind": "step", "data": {"via_scaler": False}})
        else:
            events.append({"kind": "scheduler", "data": {
                "scheduler_type": "LambdaLR", "scheduler": obj, "lr_before": lr,
                "lr": lr * factor}})
            lr *= factor
    return events


def test_two_schedulers_on_one_optimizer_once_each_is_fine():
    warm = _schedule("oss" * 3, obj=1)   # interleaved by hand below
    events = []
    for i in range(3):
        events.append({"kind": "step", "data": {"via_scaler": False}})
        events.append(warm[3 * i + 1])
        decay = dict(warm[3 * i + 2])
        decay["data"] = dict(decay["data"], scheduler=2)
        events.append(decay)
    assert scheduler_findings(None, _trace(events), "fp32-accum") == []


def test_a_decaying_scheduler_stepped_every_micro_batch():
    findings = scheduler_findings(None, _trace(_schedule("sssos" * 3)), "fp32-accum")
    assert [f.kind for f in findings] == ["scheduler-per-microbatch"]
    evidence = findings[0].evidence
    assert evidence["measured"] == 4.0
    assert evidence["max_between_optimizer_steps"] == 4
    # step 1 used the value after 7 scheduler steps, the schedule means the one after 4
    assert evidence["first_step_off"] == 1
    assert evidence["lr_used"] == 0.5 ** 7 and evidence["lr_expected"] == 0.5 ** 4


def test_a_constant_schedule_stepped_every_micro_batch_changes_nothing():
    assert scheduler_findings(None, _trace(_schedule("sssos" * 3, factor=1.0)),
                              "fp32-accum") == []


def test_one_scheduler_step_per_optimizer_step_is_fine():
    assert scheduler_findings(None, _trace(_schedule("os" * 3)), "fp32-accum") == []
