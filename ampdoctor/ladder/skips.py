"""Rung `skips`: an injected fp16 overflow is skipped and recovered from (article §§12, 13).

ampdoctor writes one inf into one parameter's gradient during one micro-batch's backward (a
one-shot tensor hook; the user's code is untouched) and checks from the trace that the window's
update was skipped, the scale backed off once (x backoff_factor, not x backoff_factor^K), the
next window started from clean gradients, and the scheduler did not advance for the skipped
step. The plain fp16 run gives the natural skip rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.enums import RungId, Status
from ..core.findings import Finding, RungResult, conclude
from ..core.safetext import exc_text, safe_str
from ..judge.step import tolerance
from ..kinds.scaling import Backoffs, StepOnInjectedInf, backoffs_in_window, step_on_injected_inf
from ..kinds.schedule import ScheduleOnSkips, schedule_on_skips
from ..kinds.skips import (
    SkipPathLeftOpen,
    SkippedAfterInjection,
    skip_path_left_open,
    skipped_after_injection,
)
from ..probe.events import (
    Event,
    OptimizerStep,
    ScalerStep,
    SchedulerStep,
    Update,
    ZeroGrad,
    of_type,
)
from ..probe.inject import OverflowInjector
from ..rules.frameworks import framework_of
from ..rules.schedule import lr_shift
from ..rules.skip_rate import frequent_skips, scale_reset
from ..session import Session, Trace
from .analysis import (
    last_unscale_pair,
    location,
    loop_error_finding,
    script_amp,
    update_missing,
)
from .series import keep, run_series

RUNG = RungId.SKIPS


def scaler_of(trace: Trace) -> Any:
    return trace.scalers[0] if trace.scalers else None


def _window_events(trace: Trace, window: int) -> list[Event]:
    """The scaler steps, updates, scheduler steps, optimizer steps and zero_grads of `window`
    (by the micro-batch last handed out), in order."""
    return [e for e in trace.events
            if isinstance(e, (ScalerStep, Update, SchedulerStep, OptimizerStep, ZeroGrad))
            and trace.window_of_event(e) == window]


def applied_windows(session: Session, trace: Trace, optimizer: int | None) -> set[int]:
    """The windows in which the optimizer really stepped (GradScaler checks inf per optimizer,
    so only the optimizer holding the poisoned parameter must skip)."""
    return {session.window_of(step, 0, trace) for step in trace.steps
            if optimizer is None or step.optimizer == optimizer}


def _owner_slot(trace: Trace, param_id: int | None) -> int | None:
    for slot, opt in enumerate(trace.optimizers):
        if any(id(p) == param_id for group in opt.param_groups for p in group["params"]):
            return slot
    return None


def _lr_changes(trace: Trace, event: SchedulerStep) -> bool:
    """Does this scheduler's learning rate ever change in the run? A constant schedule stepped
    on a skipped update changes no learning rate: nothing to report."""
    key = event.scheduler
    values: set[float] = set()
    for e in trace.events_of(SchedulerStep):
        if e.scheduler == key:
            values.update(v for v in (e.lr_before, e.lr) if v is not None)
    return len(values) != 1


def _skip_path_left_open(trace: Trace, plain: Trace, injector: OverflowInjector,
                         own_scaler: bool) -> Finding | None:
    """A hand-written overflow guard that `continue`s past step/update/zero_grad: torch refuses
    the next window's unscale_(), and the inf stays in .grad. Named when the injected overflow
    is what sent the loop down that path and the path cleared no gradients either."""
    error = trace.error
    if (error is None or not injector.fired or "unscale_()" not in safe_str(error)
            or not update_missing(trace)):
        return None
    pair = last_unscale_pair(trace)
    if pair is None:
        return None
    _, failing, between = pair
    if any(isinstance(e, (ZeroGrad, ScalerStep, OptimizerStep)) for e in between):
        return None
    zero_grads = plain.events_of(ZeroGrad)
    updates = plain.events_of(Update)
    site = (zero_grads[-1].site if zero_grads else updates[-1].site if updates else failing.site)
    return skip_path_left_open(SkipPathLeftOpen(RUNG, injector.param_name, exc_text(error),
                                                own_scaler=own_scaler,
                                                location=location(site)))


def _backoffs(updates: list[Update], backoff: float, details: dict[str, Any],
              own_scaler: bool) -> Finding | None:
    """How often the scale backed off in the injected window (recorded in `details`): more
    than once is an update per micro-batch."""
    if not (updates and updates[0].scale_before):
        return None
    before = updates[0].scale_before
    after = updates[-1].scale_after or before
    backoffs = round(math.log(after / before) / math.log(backoff)) if after != before else 0
    details["backoffs_in_injected_window"] = backoffs
    details["scale_before_after"] = [before, after]
    return backoffs_in_window(Backoffs(RUNG, backoffs, before, after, backoff,
                                       own_scaler=own_scaler,
                                       location=location(updates[-1].site)))


def _stepped_on_injected(in_window: list[Event], inject_window: int, owner: int | None,
                         applied: set[int], trace: Trace) -> bool:
    """Did a scheduler whose learning rate changes advance in the injected window although its
    update was skipped? (ampdoctor's skip: it shows the scheduler counts skipped steps; what
    that costs the user is set by the run's own skips, `_schedule_on_skips`.)"""
    sched = [e for e in of_type(in_window, SchedulerStep)
             if owner is None or e.optimizer in (None, owner)]
    return bool(sched and inject_window not in applied and _lr_changes(trace, sched[0]))


def own_precision_scaled(session: Session) -> bool:
    """Does the user's own training use a GradScaler? In spec mode the rung runs only when fp16
    is among the spec's `precisions`; a script tells by what it built when left alone (its fp32
    run records the GradScaler and autocast it asked for, before ampdoctor forced them)."""
    own = script_amp(session)
    if own is None:
        return "fp16" in session.spec.precisions
    return bool(own.scalers) or "float16" in own.dtypes


def _schedule_on_skips(session: Session, plain: Trace, owner: int | None,
                       own_scaler: bool) -> Finding | None:
    """The plain fp16 run's own skips that its scheduler advanced on, measured: how many while
    the scale settled (before the first real update) and after, and the largest change of a
    real update's learning rate against the schedule's value for that update, the calibration's
    constant shift taken as the schedule's start; the unit (`kinds.schedule.schedule_on_skips`)
    judges them."""
    steps = [e for e in plain.events_of(ScalerStep)
             if owner is None or e.optimizer in (None, owner)]
    flags = [bool(e.skipped) for e in steps]
    sched = [e for e in plain.events_of(SchedulerStep)
             if owner is None or e.optimizer in (None, owner)]
    if not (any(flags) and sched and _lr_changes(plain, sched[0])):
        return None
    events = [e for e in sched if e.scheduler == sched[0].scheduler]
    first_ok = flags.index(False) if False in flags else len(flags)

    windows = [plain.window_of_event(e) for e in (*steps, *events)]
    if None in windows:   # no windows to read: a skip's interval runs to the next scaler.step
        bounds = [e.seq for e in steps] + [math.inf]
        on_skip = [i for i, e in enumerate(steps) if e.skipped and any(
            bounds[i] < s.seq < bounds[i + 1] for s in events)]
    else:
        advanced = set(windows[len(steps):])
        on_skip = [i for i, e in enumerate(steps) if e.skipped and windows[i] in advanced]
    calibration = sum(1 for i in on_skip if i < first_ok)
    shift = lr_shift(plain, events, owner, start_shift=calibration)
    real = [s for s in plain.steps if owner is None or s.optimizer == owner]
    return schedule_on_skips(ScheduleOnSkips(
        RUNG, events[0].scheduler_type, location(events[0].site),
        calibration_skips=calibration,
        steady_skips=sum(1 for i in on_skip if i > first_ok),
        steps_after_settling=max(0, len(flags) - first_ok - 1),
        scheduler_steps=len(events), real_updates=len({s.group for s in real}),
        lr_shift=shift[0], lr_step=shift[1], lr_used=shift[2], lr_meant=shift[3],
        tolerance=tolerance(session, "fp16").rtol, own_scaler=own_scaler,
        framework=framework_of(plain)))


@dataclass
class InjectedRun:
    """The fp16 run with one overflow injected; clip-space may run it with clipping forced
    (`max_grad_norm`) and judge its other windows, so both rungs share one pass."""

    trace: Trace
    injector: OverflowInjector
    window: int
    microbatch: int
    max_grad_norm: float | None | str


def injected_run(session: Session, max_grad_norm: float | None | str = "spec",
                 capture: bool = False) -> InjectedRun:
    """Run the loop in fp16 with an overflow injected in window 1 (0 in a one-step slice);
    kept on the session for the skips rung. Its windows and events are what skips reads;
    `capture` also keeps each step's gradients (for clip-space's judge)."""
    plain = session.trace("fp16")
    K, N = session.K, session.N
    window = 1 if N >= 2 else 0
    per_window = max(1, round(plain.backward_count / max(N, 1)))
    injector = OverflowInjector(window, K, per_window)
    trace = session.run_loop("fp16", rng_seed=session.spec.seed + 1, before_backward=injector,
                             capture=capture, max_grad_norm=max_grad_norm,
                             judge_as_it_runs="fp16" if capture else None)
    session.injected = InjectedRun(trace, injector, window, window * K + K // 2, max_grad_norm)
    return session.injected


def run(session: Session) -> RungResult:
    plain = session.trace("fp16")
    if plain.error is not None:   # fp16-scaler skipped it: the backend cannot run fp16 here
        return RungResult(RUNG, Status.SKIP,
                          "the fp16 run cannot run on this device (see fp16-scaler)")
    scaler = scaler_of(plain)
    if scaler is None or not scaler.is_enabled():
        return RungResult(RUNG, Status.SKIP, "the fp16 run has no enabled GradScaler")
    findings: list[Finding] = []
    N = session.N
    own_scaler = own_precision_scaled(session)
    injected = session.injected or injected_run(session)   # windows and events only
    trace, injector, inject_window = injected.trace, injected.injector, injected.window
    target_mb = injected.microbatch
    details: dict[str, Any] = {"injected_window": inject_window, "injected_microbatch": target_mb,
                               "own_precision_scaled": own_scaler}
    label = f"fp16 run, overflow injected in window {inject_window}"
    if injected.max_grad_norm != "spec":
        details["clipping_forced_at"] = injected.max_grad_norm
        label += f", clipping forced at {injected.max_grad_norm:.3g} (shared with clip-space)"
    keep(session, run_series(RUNG, trace, label=label))
    if trace.error is not None:
        finding = (_skip_path_left_open(trace, plain, injector, own_scaler)
                   or loop_error_finding(trace, RUNG))
        return RungResult(RUNG, Status.FAIL, "the fp16 run with an injected overflow raised",
                          [finding], details=details)
    if not injector.fired:
        return RungResult(RUNG, Status.SKIP, f"micro-batch {target_mb} never reached backward; "
                          "nothing was injected", details=details)
    details["injected_parameter"] = injector.param_name
    in_window = _window_events(trace, inject_window)
    backoff = scaler_of(trace).get_backoff_factor() if scaler_of(trace) else 0.5
    scaler_steps = of_type(in_window, ScalerStep)
    skipped_flags = [bool(e.skipped) for e in trace.events_of(ScalerStep)]
    details["skipped"] = skipped_flags
    details["scale"] = [e.scale_after for e in trace.events_of(Update)]

    # The injected window must be skipped (whether scaler.step skipped it or the loop's own
    # non-finite check did).
    owner = _owner_slot(trace, injector.param_id)
    applied = applied_windows(session, trace, owner)
    applied_plain = applied_windows(session, plain, owner)
    details["applied_windows"] = sorted(applied)
    # Consequence: no optimizer may consume the inf. A step in the injected window on finite
    # gradients is fine (a loop that retries the window after the skip, as fairseq does).
    poisoned = [s for s in trace.steps if not s.finite and (owner is None or s.optimizer == owner)]
    details["steps_on_nonfinite_gradients"] = len(poisoned)
    if poisoned:
        direct = [s for s in poisoned if s.via_scaler is None]
        findings.append(step_on_injected_inf(StepOnInjectedInf(
            RUNG, injector.param_name, inject_window, len(poisoned), bool(direct),
            own_scaler=own_scaler, location=location((direct or poisoned)[0].site))))
    # The scale backs off once per window, not once per micro-batch.
    backed_off = _backoffs(of_type(in_window, Update), backoff, details, own_scaler)
    if backed_off is not None:
        findings.append(backed_off)
    # The next window must start clean: no inf carried over, so not skipped again (where the
    # plain run did update).
    in_a_row = 0
    for w in range(inject_window + 1, N):
        if w in applied or w not in applied_plain:
            break
        in_a_row += 1
    details["skipped_in_a_row_after_injection"] = in_a_row
    zero_grads = plain.events_of(ZeroGrad) or trace.events_of(ZeroGrad)
    site = (zero_grads[-1].site if zero_grads
            else scaler_steps[-1].site if scaler_steps else None)
    poisoned_next = skipped_after_injection(SkippedAfterInjection(
        RUNG, inject_window, in_a_row, tuple(applied), tuple(skipped_flags),
        own_scaler=own_scaler, location=location(site)))
    if poisoned_next is not None:
        findings.append(poisoned_next)
    # The scheduler must not advance for the user's own skipped steps (the injected one only
    # shows whether it does).
    on_injected = _stepped_on_injected(in_window, inject_window, owner, applied, trace)
    details["scheduler_stepped_on_injected_skip"] = on_injected
    stepped = _schedule_on_skips(session, plain, owner, own_scaler)
    if stepped is not None:
        findings.append(stepped)
    # A scaler rebuilt per step restarts the scale: the skips that follow are its doing.
    runs = [("fp16 run", plain),
            (f"fp16 run with an overflow injected in window {inject_window}", trace)]
    frequent = (scale_reset(runs, RUNG, own_scaler=own_scaler)
                or frequent_skips(plain, RUNG, own_scaler=own_scaler))
    if frequent is not None:
        findings.append(frequent)
    if not applied_plain and not any(f.severity == "error" for f in findings):
        # The plain run applied nothing: a skipped injected window proves nothing.
        summary = ("the plain fp16 run applied no update at all (every step overflowed), so the "
                   "injected overflow cannot be told apart")
        if not findings:
            return RungResult(RUNG, Status.SKIP, summary, details=details)
        return conclude(RUNG, findings, summary, details)
    later = any(w > inject_window for w in applied_plain)
    return conclude(RUNG, findings, f"overflow injected in window {inject_window} was skipped, "
                    "the scale backed off once"
                    + (", the next window was clean" if later else
                       " (no later window updates in the plain run to check)")
                    + (_injected_note(plain, owner) if on_injected and stepped is None else ""),
                    details)


def _injected_note(plain: Trace, owner: int | None) -> str:
    """The scheduler advanced on ampdoctor's injected skip: what that costs is the run's own
    skips, none of which it advanced on."""
    own = sum(1 for e in plain.events_of(ScalerStep)
              if e.skipped and (owner is None or e.optimizer in (None, owner)))
    return ("; the scheduler advanced on the injected skip too (each skip shifts the schedule "
            f"one step), but on none of the plain fp16 run's own skips ({own}): no shift here")
