"""The learning-rate schedule kinds: `scheduler-per-microbatch`, `scheduler-steps-on-skip`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import thresholds
from ..core.enums import KindId, Severity
from ..core.evidence import Evidence
from ..core.findings import Finding, Location
from .base import (
    FORCED_FP16,
    SCAN_RUNG,
    AccumulationLoop,
    Kind,
    Observed,
    in_framework_terms,
    skip_severity,
)

SCHEDULER_PER_MICROBATCH = Kind(
    KindId.SCHEDULER_PER_MICROBATCH,
    title="The LR scheduler steps on every micro-batch",
    why=(
        "The scheduler advances K times per optimizer step, so warmup and decay run K times too "
        "fast."),
    fix=(
        "Call `scheduler.step()` once per optimizer step, inside the `if (i + 1) % K == 0:` block "
        "after `scaler.step(optimizer)`; size the schedule in optimizer steps "
        "(`total_steps = len(loader) // K * epochs`)."),
    example=(
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    scheduler.step()                      # K times per optimizer step\n"
        "    if (i + 1) % K == 0:\n"
        "        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()"),
    error_when=(
        "an optimizer step used another learning rate than the schedule's value for that step "
        "(the scheduler stepped more than once between two steps). A constant schedule stepped "
        "per micro-batch changes nothing and is not reported."),
    measured="scheduler steps per optimizer step (LR off the schedule)",
    decided_in=f"{__name__}:scheduler_per_microbatch",
    framework_fixes={
        "accelerate":
            "Hand the scheduler to `accelerator.prepare(model, optimizer, scheduler)`: the "
            "prepared scheduler steps only when the optimizer really stepped, once per window.",
        "Lightning":
            "Return the scheduler from `configure_optimizers` with `'interval': 'step'` and let "
            "Lightning step it per optimizer step; in manual optimization call `sch.step()` under "
            "`if (batch_idx + 1) % N == 0:`.",
        "HF Trainer":
            "Let the Trainer step its scheduler (`lr_scheduler_type`, or `optimizers=(opt, "
            "sched)`): it steps once per optimizer step; a callback must not call "
            "`scheduler.step()` on `on_substep_end`.",
        "Fabric":
            "Step the scheduler with the optimizer, once per window: `if not is_accumulating: "
            "optimizer.step(); scheduler.step(); optimizer.zero_grad()`.",
        "DeepSpeed":
            "Let the engine step the schedule: give it to `deepspeed.initialize(lr_scheduler=...)` "
            "or the config's `scheduler`, and call only `engine.step()` (it steps the scheduler "
            "once per optimizer step); remove the loop's own `scheduler.step()`.",
    },
)


SCHEDULER_STEPS_ON_SKIP = Kind(
    KindId.SCHEDULER_STEPS_ON_SKIP,
    title="The LR scheduler steps when the optimizer step was skipped",
    why=(
        "GradScaler skipped the update (inf/NaN gradients) but the scheduler still advanced, so "
        "the schedule runs ahead of the real number of updates: by the few calibration skips "
        "while the scale settles (a constant shift), and at a steady skip rate r after that "
        "1/(1 - r) times too fast."),
    fix=(
        "Step the scheduler only when the optimizer stepped: `scale = scaler.get_scale()` before "
        "`scaler.step(optimizer)`; after `scaler.update()`, `if scaler.get_scale() >= scale: "
        "scheduler.step()` (a lower scale means the step was skipped)."),
    example=(
        "if (i + 1) % K == 0:\n"
        "    scaler.step(optimizer)        # may skip on inf/NaN\n"
        "    scaler.update()\n"
        "    scheduler.step()              # advances anyway\n"
        "    optimizer.zero_grad()"),
    error_when=(
        "the scheduler advanced on skips of the run's own that persist after the scale settled "
        "(at least `MIN_COUNTED_SKIPS` at a steady rate above `SCHEDULER_SKIP_RATE`: the "
        "schedule runs 1/(1 - rate) times too fast), or a skip after the calibration moved a "
        "real update's learning rate beyond the rung's tolerance. Warning, with their count: "
        "the calibration skips before the first real update (a constant shift of a few steps "
        "at the start of training), a rare later skip whose shift stays within tolerance, and "
        "any of it in a run forced into fp16. Not reported: a scheduler that advanced on the "
        "injected skip alone (the rung's summary says so)."),
    measured="steady skip rate the scheduler advanced on",
    decided_in=f"{__name__}:scheduler_steps_on_skip",
    framework_fixes={
        # the skip-aware scheduler step in the framework's own terms
        "accelerate":
            "Hand the scheduler to `accelerator.prepare(...)` with the optimizer: the "
            "prepared scheduler steps only when the prepared optimizer really stepped "
            "(`accelerator.optimizer_step_was_skipped` tells a hand-written loop).",
    },
)


def scheduler_per_microbatch(seen: Observed) -> Finding:
    """`scheduler-per-microbatch`: the LR scheduler steps on every micro-batch.
    Error: a step used another lr than the schedule's for it (a constant schedule: nothing).
    (`SCHEDULER_PER_MICROBATCH.error_when`)"""
    seen = in_framework_terms(SCHEDULER_PER_MICROBATCH, seen)
    return Finding(seen.rung, KindId.SCHEDULER_PER_MICROBATCH, seen.severity,
                   **seen.fields(SCHEDULER_PER_MICROBATCH))


def scheduler_steps_on_skip(seen: Observed) -> Finding:
    """`scheduler-steps-on-skip`: the LR scheduler steps when the optimizer step was skipped
    (severity and text from `schedule_on_skips`)."""
    seen = in_framework_terms(SCHEDULER_STEPS_ON_SKIP, seen)
    return Finding(seen.rung, KindId.SCHEDULER_STEPS_ON_SKIP, seen.severity,
                   **seen.fields(SCHEDULER_STEPS_ON_SKIP))


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
                                            location=m.location))


@dataclass(frozen=True)
class ScheduleTooFast:
    """An LR scheduler that stepped more than once between two optimizer steps, and the first
    optimizer step whose learning rate is not the schedule's for it (`lr_used` against
    `lr_meant`). `cause`: a DeepSpeed engine's sentence on who else steps the schedule."""

    rung: str
    precision: str
    scheduler_type: str
    scheduler_steps: int
    optimizer_steps: int
    max_between: int            # the most scheduler steps between two optimizer steps
    step: int                   # the first optimizer step off the schedule
    lr_used: float
    lr_meant: float
    cause: str = ""
    framework: str | None = None
    location: Location | None = None
    #: the loop raised before its run ended (OneCycleLR past total_steps): the scheduler steps
    #: after its last optimizer step are a cut interval, so the pace is `max_between`
    raised: bool = False


def schedule_too_fast(o: ScheduleTooFast) -> Finding:
    """`scheduler-per-microbatch`: a step used another learning rate than the schedule's for
    it (an error)."""
    per_step = o.max_between if o.raised else o.scheduler_steps / o.optimizer_steps
    evidence: Evidence = {"measured": round(per_step, 6), "expected": 1.0,
                          "scheduler_steps": o.scheduler_steps,
                          "optimizer_steps": o.optimizer_steps,
                          "max_between_optimizer_steps": o.max_between, "lr_used": o.lr_used,
                          "lr_expected": o.lr_meant, "first_step_off": o.step}
    if o.framework:
        evidence["framework"] = o.framework
    return scheduler_per_microbatch(Observed(o.rung, Severity.ERROR,
        f"The LR scheduler ({o.scheduler_type}) stepped {o.scheduler_steps} times for "
        f"{o.optimizer_steps} optimizer steps in the {o.precision} run, up to {o.max_between} "
        f"times between two optimizer steps: optimizer step {o.step} used lr {o.lr_used:.6g} "
        f"where the schedule gives {o.lr_meant:.6g} for that step; the schedule runs "
        f"{per_step:.3g}x too fast."
        + (" It then raised: the schedule ran out before the training did." if o.raised else "")
        + o.cause,
        evidence=evidence, location=o.location))


@dataclass(frozen=True)
class StepsPerUpdate:
    """What the sentinel counted in a real training: the scheduler's steps between each two
    optimizer steps, K or more each time (once per micro-batch)."""

    rung: str
    scheduler_type: str
    K: int
    counts: tuple[int, ...]
    location: Location | None = None


def steps_per_update(o: StepsPerUpdate) -> Finding:
    """`scheduler-per-microbatch` in a real training: the schedule runs K times too fast (an
    error)."""
    return scheduler_per_microbatch(Observed(o.rung, Severity.ERROR,
        f"The scheduler ({o.scheduler_type}) stepped {max(o.counts)} times per "
        f"optimizer step, once per micro-batch: the schedule runs {o.K}x too fast "
        "(a 10,000-step schedule is over after "
        f"{10_000 // o.K:,} real updates).",
        evidence={"measured": max(o.counts), "expected": 1, "accumulation_steps": o.K,
                  "scheduler_steps_per_update": list(o.counts)},
        location=o.location))


@dataclass(frozen=True)
class RateSetPerMicroBatch:
    """A learning rate the loop assigns by hand that took `values` (more than one) between two
    optimizer steps (`window`; `most` values in one window at most), and the first optimizer
    step whose rate is more than a step of the schedule away from the rate the same loop at
    K = 1 assigns to it (`lr_used` against `lr_meant`). `optimizer`: which one, when the loop
    steps several."""

    rung: str
    precision: str
    K: int
    window: int
    most: int
    values: tuple[float, ...]
    step: int
    lr_used: float
    lr_meant: float
    optimizer: int | None = None
    location: Location | None = None


def rate_set_per_micro_batch(o: RateSetPerMicroBatch) -> Finding:
    """`scheduler-per-microbatch` with no scheduler object: the rate is counted in
    micro-batches (an error: a step used another rate than the loop means for it)."""
    shown = ", ".join(f"{v:.6g}" for v in o.values[:6]) + (", ..." if len(o.values) > 6 else "")
    which = "" if o.optimizer is None else f" of optimizer {o.optimizer}"
    return scheduler_per_microbatch(Observed(o.rung, Severity.ERROR,
        f"The loop sets the learning rate{which} on every micro-batch: it took {o.most} "
        f"different values between two optimizer steps of the {o.precision} run (window "
        f"{o.window}: {shown}), so its schedule counts micro-batches, not optimizer steps. "
        f"Optimizer step {o.step} used lr {o.lr_used:.6g} where the same loop at K = 1 (each "
        f"window's data as one micro-batch) uses {o.lr_meant:.6g} for that step: the warm-up "
        f"and decay run about {o.K}x too fast.",
        evidence={"measured": o.most, "expected": 1, "lr_used": o.lr_used,
                  "lr_expected": o.lr_meant, "first_step_off": o.step, "window": o.window,
                  "accumulation_steps": o.K},
        location=o.location,
        fix="Compute the rate from an optimizer-step counter, not a micro-batch one: increment it "
            "after `scaler.step(optimizer)` (or use `it // K` for a micro-batch index `it`), "
            "assign it once per window, and size the warm-up and decay in optimizer steps."))


# --- the static scan: a scheduler stepped on every iteration of an accumulation loop ----------


@dataclass(frozen=True)
class SchedulerInLoop:
    """`code` (a scheduler's `.step()`, at `line`) runs on every iteration of `loop`."""

    line: int
    code: str
    loop: AccumulationLoop
    location: Location | None = None


def scheduler_in_loop(o: SchedulerInLoop) -> Finding:
    """`scheduler-per-microbatch` read in the code: a warning (a pattern; `diagnose` measures
    what it costs)."""
    k = o.loop.k_text
    return scheduler_per_microbatch(Observed(SCAN_RUNG, Severity.WARNING,
        f"`{o.code}` at line {o.line} runs on every micro-batch {o.loop.context()}: the "
        f"schedule advances {k} times per optimizer step, so warmup and decay run {k} times too "
        "fast.", evidence=o.loop.evidence(), location=o.location,
        title="scheduler.step() on every micro-batch"))
