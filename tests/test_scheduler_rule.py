"""scheduler-per-microbatch: counted per scheduler object between two optimizer steps."""

from __future__ import annotations

from types import SimpleNamespace

from ampdoctor.ladder.analysis import scheduler_findings


def _trace(events):
    seq = [SimpleNamespace(seq=i, site=None, optimizer=0, **e) for i, e in enumerate(events)]
    steps = [SimpleNamespace(group=i, seq=e.seq) for i, e in enumerate(x for x in seq
                                                                      if x.kind == "step")]
    return SimpleNamespace(events=seq, steps=steps, precision="fp32",
                           of_kind=lambda *k: [e for e in seq if e.kind in k])


def _sched(obj):
    return {"kind": "scheduler", "data": {"type": "LambdaLR", "scheduler": obj}}


STEP = {"kind": "step", "data": {"via_scaler": False}}


def test_two_schedulers_on_one_optimizer_once_each_is_fine():
    events = [STEP, _sched(1), _sched(2)] * 3
    assert scheduler_findings(None, _trace(events), "fp32-accum") == []


def test_one_scheduler_stepped_every_micro_batch():
    events = ([_sched(1)] * 3 + [STEP, _sched(1)]) * 3
    findings = scheduler_findings(None, _trace(events), "fp32-accum")
    assert [f.kind for f in findings] == ["scheduler-per-microbatch"]
    assert findings[0].evidence["measured"] == 4.0
    assert findings[0].evidence["max_between_optimizer_steps"] == 4
