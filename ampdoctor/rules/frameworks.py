"""Which party divides by K when a framework runs the accumulation, so the fix of an
accumulation-average finding names the right side: the user's line, `accelerator.backward`
(inside `accumulate()`), Lightning's automatic optimization, Fabric, the HF Trainer
(`num_items_in_batch` / loss kwargs), or DeepSpeed's `engine.backward` (`scale_wrt_gas`)."""

from __future__ import annotations

from ..enums import KindId
from ..evidence import Evidence
from ..probe.events import FrameworkPrecision
from ..probe.trace import Trace

_DOUBLE = {
    "accelerate": "`accelerator.backward` already divides the loss by gradient_accumulation_steps "
                  "inside `accelerator.accumulate()`, so the loop's own division is the second "
                  "one: remove it.",
    "HF Trainer": "the HF Trainer already divides the loss by gradient_accumulation_steps (when "
                  "the model takes no loss kwargs), so a division in compute_loss is the "
                  "second one: remove it.",
    "Lightning": "Lightning's automatic optimization already divides the loss by "
                 "accumulate_grad_batches, so a division in training_step is the second one "
                 "(manual optimization divides nowhere: there the loop must, once).",
    "Fabric": "`fabric.backward` does not divide: the loss is divided twice in the loop.",
    "DeepSpeed": "`engine.backward(loss)` already divides the loss by the config's "
                 "gradient_accumulation_steps (its `scale_wrt_gas=True` default), so the loop's "
                 "own division is the second one: remove it (or pass `scale_wrt_gas=False` and "
                 "keep exactly one).",
}
_MISSING = {
    "accelerate": "`accelerator.backward` divides by K only inside `accelerator.accumulate()` "
                  "with gradient_accumulation_steps given to the Accelerator; outside it the "
                  "loop must divide.",
    "HF Trainer": "the HF Trainer does not divide by K when the model (or compute_loss_func) "
                  "accepts loss kwargs: it passes `num_items_in_batch` and expects the loss to "
                  "be divided by it; a loss that ignores it sums the K micro-batches.",
    "Lightning": "Lightning divides by accumulate_grad_batches only in automatic optimization; "
                 "with manual optimization (`manual_backward`) the loop must divide.",
    "Fabric": "`fabric.backward` does not divide by K: the loop must divide the loss.",
    "DeepSpeed": "`engine.backward(loss, scale_wrt_gas=False)` does not divide by the config's "
                 "gradient_accumulation_steps: with it the loop must divide, once (the default "
                 "`scale_wrt_gas=True` divides for it).",
}


def who_divided(trace: Trace, kind: str) -> tuple[str, str] | None:
    """(party, sentence) for a double-average or missing-accumulation-average in a run that a
    framework drove, or None when no framework was built."""
    table = {KindId.DOUBLE_AVERAGE: _DOUBLE,
             KindId.MISSING_ACCUMULATION_AVERAGE: _MISSING}.get(KindId(kind))
    if table is None:
        return None
    for event in trace.events_of(FrameworkPrecision):
        party = event.driver or event.framework
        if party in table:
            return party, table[party]
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
