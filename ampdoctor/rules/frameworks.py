"""Which party divides by K when a framework runs the accumulation, so the fix of an
accumulation-average finding names the right side: the user's line, `accelerator.backward`
(inside `accumulate()`), Lightning's automatic optimization, Fabric, the HF Trainer
(`num_items_in_batch` / loss kwargs), or DeepSpeed's `engine.backward` (`scale_wrt_gas`)."""

from __future__ import annotations

from collections.abc import Collection

from ..core.evidence import Evidence
from ..probe.events import FrameworkPrecision
from ..probe.trace import Trace


def dividing_party(trace: Trace, parties: Collection[str]) -> str | None:
    """The first framework among `parties` (a kind's `who_divides`) that drove the run, or
    None: the kind's unit then says who divides by K there."""
    for event in trace.events_of(FrameworkPrecision):
        party = event.driver or event.framework
        if party in parties:
            return party
    return None


def framework_of(trace: Trace) -> str | None:
    """The party that drove the run (accelerate, HF Trainer, Lightning, Fabric), or None when no
    framework was built."""
    for event in trace.events_of(FrameworkPrecision):
        party = event.driver or event.framework
        if party:
            return party
    return None


def framework_evidence(trace: Trace) -> Evidence:
    """`framework` for a finding's evidence when one drove the run (its decider then says the
    fix in that framework's terms)."""
    framework = framework_of(trace)
    return {"framework": framework} if framework else {}
