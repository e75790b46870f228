"""One decider per diagnosis kind: the only place a `Finding` of that kind is built.

Rules (`rules/`) and rungs (`ladder/`), the static scan and the supervisor *observe*: they
measure a step, count calls, read a trajectory and say what they saw as an `Observed` value (the
rung, the severity, the message, the numbers in `evidence`, the user's line). The kind's decider
turns it into the `Finding`. `kinds.RULES` names each kind's decider as an importable
`module:function` (`ampdoctor explain --list --json` prints it as `decided_in`), and
tests/test_rules_table.py checks, by reading the source, that every `Finding` of a kind is built
in that function and nowhere else. Names that only label an observation (a hypothesis of
`compare`, a violation of the step state machine) go through `decide(kind, observed)`.

This module must not import torch: the static scan runs without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .findings import Evidence, Finding, KindId, Location, Severity


@dataclass(frozen=True)
class Observed:
    """What a rule or rung saw that a kind names: every field of the `Finding` but its kind
    (an empty `title` / `fix` takes the catalogue's)."""

    rung: str
    severity: Severity
    message: str
    evidence: Evidence = field(default_factory=lambda: Evidence())
    location: Location | None = None
    title: str = ""
    fix: str = ""
    traceback: str | None = None

    def fields(self) -> dict[str, Any]:
        """The keyword arguments of the `Finding` (all but the rung, the kind and severity)."""
        return {f: getattr(self, f) for f in ("message", "evidence", "location", "title", "fix",
                                              "traceback")}


def nondeterministic_baseline(seen: Observed) -> Finding:
    """`nondeterministic-baseline`: the fp32 reference is not repeatable."""
    return Finding(seen.rung, KindId.NONDETERMINISTIC_BASELINE, seen.severity, **seen.fields())


def missing_accumulation_average(seen: Observed) -> Finding:
    """`missing-accumulation-average`: the loss is not divided by the accumulation steps."""
    return Finding(seen.rung, KindId.MISSING_ACCUMULATION_AVERAGE, seen.severity, **seen.fields())


def double_average(seen: Observed) -> Finding:
    """`double-average`: the gradient is averaged twice."""
    return Finding(seen.rung, KindId.DOUBLE_AVERAGE, seen.severity, **seen.fields())


def reduction_mismatch(seen: Observed) -> Finding:
    """`reduction-mismatch`: the loss reduction does not match the averaging factor."""
    return Finding(seen.rung, KindId.REDUCTION_MISMATCH, seen.severity, **seen.fields())


def weighted_average_mismatch(seen: Observed) -> Finding:
    """`weighted-average-mismatch`: micro-batches are weighted equally although the loss is
    token/sample weighted."""
    return Finding(seen.rung, KindId.WEIGHTED_AVERAGE_MISMATCH, seen.severity, **seen.fields())


def step_per_microbatch(seen: Observed) -> Finding:
    """`step-per-microbatch`: the optimizer steps on every micro-batch."""
    return Finding(seen.rung, KindId.STEP_PER_MICROBATCH, seen.severity, **seen.fields())


def zero_grad_inside_accumulation(seen: Observed) -> Finding:
    """`zero-grad-inside-accumulation`: gradients are zeroed inside the accumulation window."""
    return Finding(seen.rung, KindId.ZERO_GRAD_INSIDE_ACCUMULATION, seen.severity, **seen.fields())


def missing_no_sync(seen: Observed) -> Finding:
    """`missing-no-sync`: DDP/FSDP synchronises gradients on the wrong micro-batches."""
    return Finding(seen.rung, KindId.MISSING_NO_SYNC, seen.severity, **seen.fields())


def sync_on_every_micro_batch(seen: Observed, *, sharded: bool, update_right: bool) -> Finding:
    """`missing-no-sync` for a loop whose gradient sync runs on more backwards than there are
    optimizer steps: the one decision of its severity.

    Under FSDP2 (`sharded`) a reduce-scatter on every micro-batch is a documented mode: each
    backward reduces its gradient into the sharded `.grad` and frees the unsharded one, so a
    rank never holds the unsharded gradient accumulated over the window; the price is K times
    the communication. When the update it produced matches the reference (`update_right`),
    that is a trade-off to know about, a warning. Under DDP the extra all-reduces save nothing
    (the accumulated gradient is held whole either way): the K-fold volume is the measured
    consequence, an error, as it is for FSDP2 when the update is also wrong."""
    severity = Severity.WARNING if sharded and update_right else Severity.ERROR
    return missing_no_sync(replace(seen, severity=severity))


def half_open_amp(seen: Observed) -> Finding:
    """`half-open-amp`: mixed precision is only half switched on (or off)."""
    return Finding(seen.rung, KindId.HALF_OPEN_AMP, seen.severity, **seen.fields())


def clip_before_unscale(seen: Observed) -> Finding:
    """`clip-before-unscale`: gradients are clipped while still scaled."""
    return Finding(seen.rung, KindId.CLIP_BEFORE_UNSCALE, seen.severity, **seen.fields())


def missing_unscale(seen: Observed) -> Finding:
    """`missing-unscale`: an optimizer steps on scaled gradients."""
    return Finding(seen.rung, KindId.MISSING_UNSCALE, seen.severity, **seen.fields())


def unscale_twice(seen: Observed) -> Finding:
    """`unscale-twice`: gradients are unscaled twice."""
    return Finding(seen.rung, KindId.UNSCALE_TWICE, seen.severity, **seen.fields())


def update_per_microbatch(seen: Observed) -> Finding:
    """`update-per-microbatch`: `scaler.update()` runs on every micro-batch."""
    return Finding(seen.rung, KindId.UPDATE_PER_MICROBATCH, seen.severity, **seen.fields())


def double_scaling(seen: Observed) -> Finding:
    """`double-scaling`: two loss-scale state machines on one loss."""
    return Finding(seen.rung, KindId.DOUBLE_SCALING, seen.severity, **seen.fields())


def scheduler_per_microbatch(seen: Observed) -> Finding:
    """`scheduler-per-microbatch`: the LR scheduler steps on every micro-batch."""
    return Finding(seen.rung, KindId.SCHEDULER_PER_MICROBATCH, seen.severity, **seen.fields())


def scheduler_steps_on_skip(seen: Observed) -> Finding:
    """`scheduler-steps-on-skip`: the LR scheduler steps when the optimizer step was skipped."""
    return Finding(seen.rung, KindId.SCHEDULER_STEPS_ON_SKIP, seen.severity, **seen.fields())


def no_zero_grad_after_skip(seen: Observed) -> Finding:
    """`no-zero-grad-after-skip`: gradients are not cleared after a skipped step."""
    return Finding(seen.rung, KindId.NO_ZERO_GRAD_AFTER_SKIP, seen.severity, **seen.fields())


def missing_zero_grad(seen: Observed) -> Finding:
    """`missing-zero-grad`: gradients are carried from one optimizer step into the next."""
    return Finding(seen.rung, KindId.MISSING_ZERO_GRAD, seen.severity, **seen.fields())


def frequent_skips(seen: Observed) -> Finding:
    """`frequent-skips`: fp16 skips updates too often."""
    return Finding(seen.rung, KindId.FREQUENT_SKIPS, seen.severity, **seen.fields())


def gradient_mismatch(seen: Observed) -> Finding:
    """`gradient-mismatch`: the update differs from the reference in no known shape."""
    return Finding(seen.rung, KindId.GRADIENT_MISMATCH, seen.severity, **seen.fields())


def loop_error(seen: Observed) -> Finding:
    """`loop-error`: the training loop raised an error."""
    return Finding(seen.rung, KindId.LOOP_ERROR, seen.severity, **seen.fields())


#: kind -> its decider, for the observations that carry a kind as data.
DECIDERS: dict[str, Callable[[Observed], Finding]] = {
    KindId.NONDETERMINISTIC_BASELINE: nondeterministic_baseline,
    KindId.MISSING_ACCUMULATION_AVERAGE: missing_accumulation_average,
    KindId.DOUBLE_AVERAGE: double_average,
    KindId.REDUCTION_MISMATCH: reduction_mismatch,
    KindId.WEIGHTED_AVERAGE_MISMATCH: weighted_average_mismatch,
    KindId.STEP_PER_MICROBATCH: step_per_microbatch,
    KindId.ZERO_GRAD_INSIDE_ACCUMULATION: zero_grad_inside_accumulation,
    KindId.MISSING_NO_SYNC: missing_no_sync,
    KindId.HALF_OPEN_AMP: half_open_amp,
    KindId.CLIP_BEFORE_UNSCALE: clip_before_unscale,
    KindId.MISSING_UNSCALE: missing_unscale,
    KindId.UNSCALE_TWICE: unscale_twice,
    KindId.UPDATE_PER_MICROBATCH: update_per_microbatch,
    KindId.DOUBLE_SCALING: double_scaling,
    KindId.SCHEDULER_PER_MICROBATCH: scheduler_per_microbatch,
    KindId.SCHEDULER_STEPS_ON_SKIP: scheduler_steps_on_skip,
    KindId.NO_ZERO_GRAD_AFTER_SKIP: no_zero_grad_after_skip,
    KindId.MISSING_ZERO_GRAD: missing_zero_grad,
    KindId.FREQUENT_SKIPS: frequent_skips,
    KindId.GRADIENT_MISMATCH: gradient_mismatch,
    KindId.LOOP_ERROR: loop_error,
}


def decide(kind: str, seen: Observed) -> Finding:
    """The finding of `kind` for an observation that names its kind as data (a hypothesis that
    matched, a violation of the step state machine, a rank's finding sent over a pipe)."""
    decider = DECIDERS.get(kind)
    if decider is None:
        raise ValueError(f"unknown finding kind {kind!r}")
    return decider(seen)


def from_dict(data: dict[str, Any]) -> Finding:
    """A finding another process decided and sent as `Finding.to_dict()`, rebuilt by the
    decider of its kind."""
    data = dict(data)
    kind = data.pop("kind")
    if isinstance(data.get("location"), dict):
        data["location"] = Location(**data["location"])
    return decide(kind, Observed(**data))
