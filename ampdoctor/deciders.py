"""One decider per diagnosis kind: the only place a `Finding` of that kind is built.

Rules (`rules/`) and rungs (`ladder/`), the static scan and the supervisor *observe*: they
measure a step, count calls, read a trajectory and say what they saw as an `Observed` value (the
rung, the severity, the message, the numbers in `evidence`, the user's line). The kind's decider
turns it into the `Finding`. `kinds.RULES` names each kind's decider as an importable
`module:function` (`ampdoctor explain --list --json` prints it as `decided_in`), and
tests/test_rules_table.py checks, by reading the source, that every `Finding` of a kind is built
in that function and nowhere else. Names that only label an observation (a hypothesis of
`compare`, a violation of the step state machine) go through `decide(kind, observed)`.

Each decider's docstring says what measured consequence makes its kind an `error`; the full
answer per kind is `kind_text.ERROR_WHEN`, which docs/kinds.md repeats (tests/test_deciders.py
checks they agree).

This module must not import torch: the static scan runs without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import thresholds
from .findings import Evidence, Finding, KindId, Location, Severity
from .kind_text import FRAMEWORK_FIXES, SKIP_AWARE_FIX


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


def _in_framework_terms(kind: str, seen: Observed) -> Observed:
    """The observation with its fix in the terms of the framework that drove the run, when
    the rule wrote none of its own and the table has one."""
    framework = seen.evidence.get("framework")
    fix = FRAMEWORK_FIXES.get((kind, framework)) if isinstance(framework, str) else None
    return replace(seen, fix=fix) if fix and not seen.fix else seen


def nondeterministic_baseline(seen: Observed) -> Finding:
    """`nondeterministic-baseline`: the fp32 reference is not repeatable.
    Error: two fp32 reference runs differ (always measured). (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.NONDETERMINISTIC_BASELINE, seen.severity, **seen.fields())


def missing_accumulation_average(seen: Observed) -> Finding:
    """`missing-accumulation-average`: the loss is not divided by the accumulation steps.
    Error: a consumed gradient K x the reference (no warning form). (kind_text.ERROR_WHEN)"""
    seen = _in_framework_terms(KindId.MISSING_ACCUMULATION_AVERAGE, seen)
    return Finding(seen.rung, KindId.MISSING_ACCUMULATION_AVERAGE, seen.severity, **seen.fields())


def double_average(seen: Observed) -> Finding:
    """`double-average`: the gradient is averaged twice.
    Error: a consumed gradient 1/K (1/world_size, K/divisor) of the reference.
    (kind_text.ERROR_WHEN)"""
    seen = _in_framework_terms(KindId.DOUBLE_AVERAGE, seen)
    return Finding(seen.rung, KindId.DOUBLE_AVERAGE, seen.severity, **seen.fields())


def reduction_mismatch(seen: Observed) -> Finding:
    """`reduction-mismatch`: the loss reduction does not match the averaging factor.
    Error: a consumed gradient a count times the reference, or a varying factor.
    (kind_text.ERROR_WHEN)"""
    seen = _in_framework_terms(KindId.REDUCTION_MISMATCH, seen)
    return Finding(seen.rung, KindId.REDUCTION_MISMATCH, seen.severity, **seen.fields())


def weighted_average_mismatch(seen: Observed) -> Finding:
    """`weighted-average-mismatch`: micro-batches are weighted equally although the loss is
    token/sample weighted.
    Error: off the weighted reference, on the equal-weight mean. (kind_text.ERROR_WHEN)"""
    seen = _in_framework_terms(KindId.WEIGHTED_AVERAGE_MISMATCH, seen)
    return Finding(seen.rung, KindId.WEIGHTED_AVERAGE_MISMATCH, seen.severity, **seen.fields())


def step_per_microbatch(seen: Observed) -> Finding:
    """`step-per-microbatch`: the optimizer steps on every micro-batch.
    Error: more optimizer steps than windows (another parameter trajectory).
    (kind_text.ERROR_WHEN)"""
    seen = _in_framework_terms(KindId.STEP_PER_MICROBATCH, seen)
    return Finding(seen.rung, KindId.STEP_PER_MICROBATCH, seen.severity, **seen.fields())


def zero_grad_inside_accumulation(seen: Observed) -> Finding:
    """`zero-grad-inside-accumulation`: gradients are zeroed inside the accumulation window.
    Error: an update off the reference, only the micro-batches after the zero_grad in it.
    (kind_text.ERROR_WHEN)"""
    seen = _in_framework_terms(KindId.ZERO_GRAD_INSIDE_ACCUMULATION, seen)
    return Finding(seen.rung, KindId.ZERO_GRAD_INSIDE_ACCUMULATION, seen.severity, **seen.fields())


def missing_no_sync(seen: Observed) -> Finding:
    """`missing-no-sync`: DDP/FSDP synchronises gradients on the wrong micro-batches.
    Error / warning: `sync_on_every_micro_batch`, or a sync on the wrong backward (ranks drift).
    (kind_text.ERROR_WHEN)"""
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
    """`half-open-amp`: mixed precision is only half switched on (or off).
    Error: the precision that ran is not the one asked for (fp32: an update differs); warning: a
    scaler in bf16, autocast in an fp32 run that still matches. (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.HALF_OPEN_AMP, seen.severity, **seen.fields())


def clip_before_unscale(seen: Observed) -> Finding:
    """`clip-before-unscale`: gradients are clipped while still scaled.
    Error: the scaled-space clip changed the update; warning: it has not bitten yet.
    (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.CLIP_BEFORE_UNSCALE, seen.severity, **seen.fields())


def missing_unscale(seen: Observed) -> Finding:
    """`missing-unscale`: an optimizer steps on scaled gradients.
    Error: an update S x the reference or on the injected inf; warning: the scale was 1.
    (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.MISSING_UNSCALE, seen.severity, **seen.fields())


def unscale_twice(seen: Observed) -> Finding:
    """`unscale-twice`: gradients are unscaled twice.
    Error: an update 1/S of the reference, or torch refused the second unscale_.
    (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.UNSCALE_TWICE, seen.severity, **seen.fields())


def update_per_microbatch(seen: Observed) -> Finding:
    """`update-per-microbatch`: `scaler.update()` runs on every micro-batch.
    Error: the loss-scale trajectory differs (backed off more than once). (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.UPDATE_PER_MICROBATCH, seen.severity, **seen.fields())


def double_scaling(seen: Observed) -> Finding:
    """`double-scaling`: two loss-scale state machines on one loss.
    Error: a second scale factor measured, or two owners on one path (two GradScalers: seen
    by the run on one loss or optimizer); warning: separate entry points, or GradScalers no
    run could tell apart. (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.DOUBLE_SCALING, seen.severity, **seen.fields())


def scheduler_per_microbatch(seen: Observed) -> Finding:
    """`scheduler-per-microbatch`: the LR scheduler steps on every micro-batch.
    Error: a step used another lr than the schedule's for it (a constant schedule: nothing).
    (kind_text.ERROR_WHEN)"""
    seen = _in_framework_terms(KindId.SCHEDULER_PER_MICROBATCH, seen)
    return Finding(seen.rung, KindId.SCHEDULER_PER_MICROBATCH, seen.severity, **seen.fields())


def scheduler_steps_on_skip(seen: Observed) -> Finding:
    """`scheduler-steps-on-skip`: the LR scheduler steps when the optimizer step was skipped
    (severity and text from `schedule_on_skips`)."""
    return Finding(seen.rung, KindId.SCHEDULER_STEPS_ON_SKIP, seen.severity, **seen.fields())


#: A rung that forced fp16 onto a run whose own precision has no GradScaler: what it found is
#: what fp16 would do, said as such.
FORCED_FP16 = (" This training's own precision uses no GradScaler: this is what it would do "
               "in fp16, not a failure of the run as it trains.")


def skip_severity(consequence: bool, *, own_scaler: bool) -> Severity:
    """The skips rung's one rule for what may fail a run: a measured consequence is an error
    when the user's own precision uses a GradScaler; in a run the rung forced into fp16 (its own
    precision bf16 or fp32, no scaler, no skips) it is a warning about what fp16 would do."""
    return Severity.ERROR if consequence and own_scaler else Severity.WARNING


@dataclass(frozen=True)
class ScheduleOnSkips:
    """What the skips rung measured of a scheduler that advanced on skipped optimizer steps in
    the plain fp16 run (the user's own skips: ampdoctor's injected overflow stands for one skip
    and shifts nothing in the user's training by itself)."""

    rung: str
    scheduler_type: str
    location: Location | None
    calibration_skips: int      # skips before the first real update (the scale settling)
    steady_skips: int           # skips after it, the scheduler advanced on each
    steps_after_settling: int   # optimizer steps after the first real update
    scheduler_steps: int
    real_updates: int
    lr_shift: float             # largest |lr used - lr meant| / lr meant, calibration's shift out
    lr_step: int | None         # the real update (0-based) where it was measured
    lr_used: float | None
    lr_meant: float | None
    tolerance: float            # the rung's rtol (an update moves with its learning rate)
    own_scaler: bool            # the user's own precision uses a GradScaler
    framework: str | None = None

    @property
    def rate(self) -> float:
        """The steady-state skip rate the schedule advanced on."""
        return self.steady_skips / self.steps_after_settling if self.steps_after_settling else 0.0

    @property
    def persistent(self) -> bool:
        """Skips that go on after the scale settled, more than one overflow can explain
        (thresholds.MIN_COUNTED_SKIPS) at a rate above thresholds.SCHEDULER_SKIP_RATE."""
        return (self.steady_skips >= thresholds.MIN_COUNTED_SKIPS
                and self.rate > thresholds.SCHEDULER_SKIP_RATE)

    @property
    def shifted(self) -> bool:
        """A skip after calibration moved a real update's learning rate beyond the rung's
        rtol (the calibration's constant shift taken as the schedule's start)."""
        return self.lr_shift > self.tolerance


def schedule_on_skips(m: ScheduleOnSkips) -> Finding | None:
    """`scheduler-steps-on-skip` from the numbers: None when the scheduler advanced on none of
    the run's own skips. An error when the skips persist after the scale settled (the schedule
    runs 1/(1-rate) times too fast for the rest of training) or a skip after calibration shifted
    a real update's learning rate beyond the rung's tolerance; a warning, with their count, for
    the skips of the scale's calibration (a constant shift of a few steps at the start of
    training) and for a rare later skip whose shift stays within tolerance; a warning in a run
    forced into fp16 (`skip_severity`)."""
    if not (m.calibration_skips or m.steady_skips):
        return None
    severity = skip_severity(m.persistent or m.shifted, own_scaler=m.own_scaler)
    real = f"{m.scheduler_steps} scheduler steps for {m.real_updates} real updates"
    calibration = (f"; before it, the {m.calibration_skips} skip(s) of the scale's calibration "
                   "shift the schedule by as many steps" if m.calibration_skips else "")
    if m.persistent:
        fast = (f"the schedule runs {1 / (1 - m.rate):.3g}x too fast, so a 10,000-step "
                f"schedule ends after {10_000 * (1 - m.rate):,.0f} real updates" if m.rate < 1
                else "the schedule runs on while no update is made")
        text = (f"After the scale settled the fp16 run skipped {m.steady_skips} of the "
                f"{m.steps_after_settling} steps that followed (a steady skip rate of "
                f"{m.rate:.0%}) and the scheduler ({m.scheduler_type}) advanced on every one "
                f"({real}): {fast}{calibration}.")
    elif m.steady_skips:
        text = (f"The scheduler ({m.scheduler_type}) advanced on {m.steady_skips} skip(s) after "
                f"the scale settled ({m.steady_skips} of {m.steps_after_settling} steps; "
                f"{real}){calibration}.")
    else:
        text = (f"The scheduler ({m.scheduler_type}) advanced on the {m.calibration_skips} "
                f"skip(s) of the scale's calibration, before the first real update ({real}): "
                f"the schedule starts {m.calibration_skips} step(s) ahead of the real updates, a "
                "constant shift while later skips stay rare (each one adds a step).")
    if m.shifted and m.lr_step is not None:
        after = " (after the calibration)" if m.calibration_skips else ""
        text += (f" Real update {m.lr_step} used lr {m.lr_used:.6g} where the schedule{after} "
                 f"gives {m.lr_meant:.6g} for it ({m.lr_shift:.1%} off, beyond the rung's "
                 f"tolerance {m.tolerance:g}).")
    elif m.steady_skips and not m.persistent:
        text += (f" The shift moves no real update's learning rate beyond the rung's tolerance "
                 f"(largest {m.lr_shift:.2%}, tolerance {m.tolerance:g}).")
    if not m.own_scaler:
        text += FORCED_FP16
    evidence: Evidence = {"measured": round(m.rate, 6), "expected": 0.0,
                          "steady_skip_rate": round(m.rate, 6),
                          "threshold": thresholds.SCHEDULER_SKIP_RATE,
                          "calibration_skips": m.calibration_skips,
                          "steady_skips": m.steady_skips,
                          "steps_after_settling": m.steps_after_settling,
                          "scheduler_steps": m.scheduler_steps, "optimizer_steps": m.real_updates,
                          "lr_shift": round(m.lr_shift, 6), "tolerance": m.tolerance,
                          "own_precision_scaled": m.own_scaler}
    if m.framework:
        evidence["framework"] = m.framework
    return scheduler_steps_on_skip(Observed(m.rung, severity, text, evidence=evidence,
                                            location=m.location,
                                            fix=SKIP_AWARE_FIX.get(m.framework or "", "")))


def no_zero_grad_after_skip(seen: Observed) -> Finding:
    """`no-zero-grad-after-skip`: gradients are not cleared after a skipped step.
    Error: windows after the injected overflow skipped too (`skip_severity`).
    (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.NO_ZERO_GRAD_AFTER_SKIP, seen.severity, **seen.fields())


def missing_zero_grad(seen: Observed) -> Finding:
    """`missing-zero-grad`: gradients are carried from one optimizer step into the next.
    Error: a step consumed an earlier window's gradient too. (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.MISSING_ZERO_GRAD, seen.severity, **seen.fields())


def frequent_skips(seen: Observed) -> Finding:
    """`frequent-skips`: fp16 skips updates too often.
    Error: skips after the first real update above the threshold (`skip_severity`); warning:
    settling. (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.FREQUENT_SKIPS, seen.severity, **seen.fields())


def gradient_mismatch(seen: Observed) -> Finding:
    """`gradient-mismatch`: the update differs from the reference in no known shape.
    Error: an update off the reference in no known shape. (kind_text.ERROR_WHEN)"""
    return Finding(seen.rung, KindId.GRADIENT_MISMATCH, seen.severity, **seen.fields())


def loop_error(seen: Observed) -> Finding:
    """`loop-error`: the training loop raised an error.
    Error: the loop raised or hung (exit 3). (kind_text.ERROR_WHEN)"""
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
