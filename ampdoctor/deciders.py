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

from .findings import Finding, Location, Severity


@dataclass(frozen=True)
class Observed:
    """What a rule or rung saw that a kind names: every field of the `Finding` but its kind
    (an empty `title` / `fix` takes the catalogue's)."""

    rung: str
    severity: Severity
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
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
    return Finding(seen.rung, "nondeterministic-baseline", seen.severity, **seen.fields())


def missing_accumulation_average(seen: Observed) -> Finding:
    """`missing-accumulation-average`: the loss is not divided by the accumulation steps."""
    return Finding(seen.rung, "missing-accumulation-average", seen.severity, **seen.fields())


def double_average(seen: Observed) -> Finding:
    """`double-average`: the gradient is averaged twice."""
    return Finding(seen.rung, "double-average", seen.severity, **seen.fields())


def reduction_mismatch(seen: Observed) -> Finding:
    """`reduction-mismatch`: the loss reduction does not match the averaging factor."""
    return Finding(seen.rung, "reduction-mismatch", seen.severity, **seen.fields())


def weighted_average_mismatch(seen: Observed) -> Finding:
    """`weighted-average-mismatch`: micro-batches are weighted equally although the loss is
    token/sample weighted."""
    return Finding(seen.rung, "weighted-average-mismatch", seen.severity, **seen.fields())


def step_per_microbatch(seen: Observed) -> Finding:
    """`step-per-microbatch`: the optimizer steps on every micro-batch."""
    return Finding(seen.rung, "step-per-microbatch", seen.severity, **seen.fields())


def zero_grad_inside_accumulation(seen: Observed) -> Finding:
    """`zero-grad-inside-accumulation`: gradients are zeroed inside the accumulation window."""
    return Finding(seen.rung, "zero-grad-inside-accumulation", seen.severity, **seen.fields())


def missing_no_sync(seen: Observed) -> Finding:
    """`missing-no-sync`: DDP/FSDP synchronises gradients on the wrong micro-batches."""
    return Finding(seen.rung, "missing-no-sync", seen.severity, **seen.fields())


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
    severity: Severity = "warning" if sharded and update_right else "error"
    return missing_no_sync(replace(seen, severity=severity))


def half_open_amp(seen: Observed) -> Finding:
    """`half-open-amp`: mixed precision is only half switched on (or off)."""
    return Finding(seen.rung, "half-open-amp", seen.severity, **seen.fields())


def clip_before_unscale(seen: Observed) -> Finding:
    """`clip-before-unscale`: gradients are clipped while still scaled."""
    return Finding(seen.rung, "clip-before-unscale", seen.severity, **seen.fields())


def missing_unscale(seen: Observed) -> Finding:
    """`missing-unscale`: an optimizer steps on scaled gradients."""
    return Finding(seen.rung, "missing-unscale", seen.severity, **seen.fields())


def unscale_twice(seen: Observed) -> Finding:
    """`unscale-twice`: gradients are unscaled twice."""
    return Finding(seen.rung, "unscale-twice", seen.severity, **seen.fields())


def update_per_microbatch(seen: Observed) -> Finding:
    """`update-per-microbatch`: `scaler.update()` runs on every micro-batch."""
    return Finding(seen.rung, "update-per-microbatch", seen.severity, **seen.fields())


def double_scaling(seen: Observed) -> Finding:
    """`double-scaling`: two loss-scale state machines on one loss."""
    return Finding(seen.rung, "double-scaling", seen.severity, **seen.fields())


def scheduler_per_microbatch(seen: Observed) -> Finding:
    """`scheduler-per-microbatch`: the LR scheduler steps on every micro-batch."""
    return Finding(seen.rung, "scheduler-per-microbatch", seen.severity, **seen.fields())


def scheduler_steps_on_skip(seen: Observed) -> Finding:
    """`scheduler-steps-on-skip`: the LR scheduler steps when the optimizer step was skipped."""
    return Finding(seen.rung, "scheduler-steps-on-skip", seen.severity, **seen.fields())


def no_zero_grad_after_skip(seen: Observed) -> Finding:
    """`no-zero-grad-after-skip`: gradients are not cleared after a skipped step."""
    return Finding(seen.rung, "no-zero-grad-after-skip", seen.severity, **seen.fields())


def missing_zero_grad(seen: Observed) -> Finding:
    """`missing-zero-grad`: gradients are carried from one optimizer step into the next."""
    return Finding(seen.rung, "missing-zero-grad", seen.severity, **seen.fields())


def frequent_skips(seen: Observed) -> Finding:
    """`frequent-skips`: fp16 skips updates too often."""
    return Finding(seen.rung, "frequent-skips", seen.severity, **seen.fields())


def gradient_mismatch(seen: Observed) -> Finding:
    """`gradient-mismatch`: the update differs from the reference in no known shape."""
    return Finding(seen.rung, "gradient-mismatch", seen.severity, **seen.fields())


def loop_error(seen: Observed) -> Finding:
    """`loop-error`: the training loop raised an error."""
    return Finding(seen.rung, "loop-error", seen.severity, **seen.fields())


#: kind -> its decider, for the observations that carry a kind as data.
DECIDERS: dict[str, Callable[[Observed], Finding]] = {
    "nondeterministic-baseline": nondeterministic_baseline,
    "missing-accumulation-average": missing_accumulation_average,
    "double-average": double_average,
    "reduction-mismatch": reduction_mismatch,
    "weighted-average-mismatch": weighted_average_mismatch,
    "step-per-microbatch": step_per_microbatch,
    "zero-grad-inside-accumulation": zero_grad_inside_accumulation,
    "missing-no-sync": missing_no_sync,
    "half-open-amp": half_open_amp,
    "clip-before-unscale": clip_before_unscale,
    "missing-unscale": missing_unscale,
    "unscale-twice": unscale_twice,
    "update-per-microbatch": update_per_microbatch,
    "double-scaling": double_scaling,
    "scheduler-per-microbatch": scheduler_per_microbatch,
    "scheduler-steps-on-skip": scheduler_steps_on_skip,
    "no-zero-grad-after-skip": no_zero_grad_after_skip,
    "missing-zero-grad": missing_zero_grad,
    "frequent-skips": frequent_skips,
    "gradient-mismatch": gradient_mismatch,
    "loop-error": loop_error,
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
