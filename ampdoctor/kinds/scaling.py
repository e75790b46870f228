"""The loss-scale kinds: unscaling, updating and owning the scale: `missing-unscale`,
`unscale-twice`, `update-per-microbatch`, `double-scaling`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.enums import KindId, Severity
from ..core.evidence import Evidence, significant
from ..core.findings import Finding, Location
from .base import FORCED_FP16, Kind, Observed, call_order_verdict, skip_severity

MISSING_UNSCALE = Kind(
    KindId.MISSING_UNSCALE,
    title="An optimizer steps on scaled gradients",
    why=(
        "The optimizer's `.step()` runs while its gradients are still multiplied by the loss scale "
        "(e.g. a second optimizer stepped directly instead of through `scaler.step`): its update "
        "is S times too large, and overflow is never checked."),
    fix=(
        "Step every optimizer through the scaler: `scaler.unscale_(opt)` (before clipping) and "
        "`scaler.step(opt)` for each one, then `scaler.update()` once per optimizer step; never "
        "`opt.step()` on gradients that `scaler.scale(loss)` produced."),
    example=(
        "scaler.scale(loss).backward()\n"
        "scaler.unscale_(backbone_opt)\n"
        "scaler.step(backbone_opt)\n"
        "head_opt.step()         # second optimizer: grads still x S, no inf check\n"
        "scaler.update()"),
    error_when=(
        "an optimizer consumed gradients still multiplied by the loss scale (the update is S "
        "times the reference) or consumed the injected inf. Warning: the update matched only "
        "because the scale was 1."),
    measured="consumed / reference gradient norm (S); steps on non-finite grads",
    decided_in=f"{__name__}:missing_unscale",
    matched=(
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient = {label}: it "
        "stepped on scaled gradients."),
)


UNSCALE_TWICE = Kind(
    KindId.UNSCALE_TWICE,
    title="Gradients are unscaled twice",
    why=(
        "`unscale_` (or a hand-written division by the scale) runs twice on the same gradients in "
        "one optimizer step, so they are divided by S twice."),
    fix=(
        "Call `scaler.unscale_(optimizer)` once per optimizer per step, after the window's last "
        "backward (not per micro-batch), and never divide `.grad` by `scaler.get_scale()` by "
        "hand."),
    example=(
        "scaler.unscale_(optimizer)\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "inv = 1.0 / scaler.get_scale()\n"
        "for p in model.parameters():\n"
        "    p.grad.mul_(inv)            # unscaled a second time\n"
        "scaler.step(optimizer)"),
    error_when=(
        "an update is 1/S of the reference, or torch refused the second unscale_ of a step."),
    measured="unscale_ calls per step, or consumed / reference (1/S)",
    decided_in=f"{__name__}:unscale_twice",
    matched=(
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient = {label}: the "
        "gradients were divided by the scale twice."),
)


UPDATE_PER_MICROBATCH = Kind(
    KindId.UPDATE_PER_MICROBATCH,
    title="`scaler.update()` runs on every micro-batch",
    why=(
        "The scale is updated K times per optimizer step, so one overflowing micro-batch backs the "
        "scale off K times and growth happens K times too fast."),
    fix=(
        "Call `scaler.update()` once per optimizer step, right after `scaler.step(optimizer)`, "
        "inside the `if (i + 1) % K == 0:` block."),
    example=(
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    scaler.update()                       # every micro-batch\n"
        "    if (i + 1) % K == 0:\n"
        "        scaler.step(optimizer)\n"
        "        optimizer.zero_grad()"),
    error_when=(
        "the loss-scale trajectory differs: one overflowing micro-batch backed the scale off "
        "more than once, or torch refused an update() with no inf check before it."),
    measured="scale backoffs for one overflowing window",
    decided_in=f"{__name__}:update_per_microbatch",
)





def missing_unscale(seen: Observed) -> Finding:
    """`missing-unscale`: an optimizer steps on scaled gradients.
    Error: an update S x the reference or on the injected inf; warning: the scale was 1.
    (`MISSING_UNSCALE.error_when`)"""
    return Finding(seen.rung, KindId.MISSING_UNSCALE, seen.severity,
                   **seen.fields(MISSING_UNSCALE))


def unscale_twice(seen: Observed) -> Finding:
    """`unscale-twice`: gradients are unscaled twice.
    Error: an update 1/S of the reference, or torch refused the second unscale_.
    (`UNSCALE_TWICE.error_when`)"""
    return Finding(seen.rung, KindId.UNSCALE_TWICE, seen.severity, **seen.fields(UNSCALE_TWICE))


def update_per_microbatch(seen: Observed) -> Finding:
    """`update-per-microbatch`: `scaler.update()` runs on every micro-batch.
    Error: the loss-scale trajectory differs (backed off more than once).
    (`UPDATE_PER_MICROBATCH.error_when`)"""
    return Finding(seen.rung, KindId.UPDATE_PER_MICROBATCH, seen.severity,
                   **seen.fields(UPDATE_PER_MICROBATCH))





@dataclass(frozen=True)
class Backoffs:
    """How often the scale backed off in the window the skips rung injected one overflow
    into, from the scale before and after its updates."""

    rung: str
    backoffs: int
    scale_before: float
    scale_after: float
    backoff_factor: float
    own_scaler: bool = True             # the user's own precision uses a GradScaler
    location: Location | None = None    # the window's last scaler.update()


def backoffs_in_window(o: Backoffs) -> Finding | None:
    """`update-per-microbatch` when one overflowing micro-batch backed the scale off more than
    once (the scale trajectory differs): an error in a run whose own precision uses a
    GradScaler (`skip_severity`); None for one backoff."""
    if o.backoffs <= 1:
        return None
    return update_per_microbatch(Observed(o.rung,
        skip_severity(True, own_scaler=o.own_scaler),
        f"One overflowing micro-batch backed the scale off {o.backoffs} times "
        f"({o.scale_before:g} -> {o.scale_after:g}, backoff factor {o.backoff_factor:g}): "
        "scaler.update() runs more than once per optimizer step."
        + ("" if o.own_scaler else FORCED_FP16),
        evidence={"measured": o.backoffs, "expected": 1, "scale_before": o.scale_before,
                  "scale_after": o.scale_after, "backoff_factor": o.backoff_factor},
        location=o.location))


@dataclass(frozen=True)
class RefusedUpdate:
    """torch refused a scaler.update() with no inf check recorded before it: the updates that
    ran after the run's last scaler.step, before the window's own step."""

    rung: str
    updates_before_step: int
    error: str
    microbatch: Any = None
    location: Location | None = None


def refused_update_finding(o: RefusedUpdate) -> Finding:
    """`update-per-microbatch` for an update torch refused: the loop could not go on, an
    error."""
    return update_per_microbatch(Observed(o.rung, Severity.ERROR,
        "scaler.update() was called again before any unscale_/step of the window: "
        "torch refused it ('No inf checks were recorded prior to update'). The "
        "scale must be updated once per optimizer step, not per micro-batch.",
        evidence={"measured": o.updates_before_step, "expected": 0,
                  "updates_before_the_windows_step": o.updates_before_step,
                  "error": o.error, "microbatch": o.microbatch},
        location=o.location))


# --- what the step state machine saw (rules/scale_state.py) ----------------------------------


@dataclass(frozen=True)
class StepOnScaled:
    """An optimizer's own .step() on gradients still multiplied by the loss scale (scaler.step
    bypassed): its consumed gradient against the reference (`ratio`, None when unknown).
    `update_matched`: every fp16 update matched the reference."""

    kind: ClassVar[KindId] = KindId.MISSING_UNSCALE
    rung: str
    window: int
    scale: float | None
    optimizer: int | None
    ratio: float | None
    location: Location | None = None
    update_matched: bool = False
    unmeasured: bool = False            # no reference run compared the update (a script)


def step_on_scaled(o: StepOnScaled) -> Finding:
    """`missing-unscale` from the state machine: an error where it explains a mismatch, a
    warning while every update matched (the scale was 1)."""
    evidence: Evidence = {"scale": o.scale, "window": o.window,
                          "measured": significant(o.ratio) if o.ratio else None,
                          "expected": 1.0, "optimizer": o.optimizer}
    message = (f"Optimizer {o.optimizer} stepped with its own .step() on gradients still "
               f"multiplied by the loss scale {o.scale:g}"
               + (f": its gradient is {o.ratio:.6g}x the reference." if o.ratio else ".")
               + " scaler.step() was bypassed, so it was never unscaled nor checked for "
                 "inf.")
    severity, text = call_order_verdict(
        message, "optimizer.step() bypassed scaler.step(), so no inf check guards it; it "
        "matched only because the scale was 1 here",
        update_matched=o.update_matched, unmeasured=o.unmeasured)
    return missing_unscale(Observed(o.rung, severity, text, evidence=evidence,
                                    location=o.location))


@dataclass(frozen=True)
class SecondUnscale:
    """unscale_() called twice on one optimizer in one step, as the state machine saw it."""

    kind: ClassVar[KindId] = KindId.UNSCALE_TWICE
    rung: str
    window: int
    scale: float | None
    location: Location | None = None
    update_matched: bool = False
    unmeasured: bool = False            # no reference run compared the update (a script)


def second_unscale(o: SecondUnscale) -> Finding:
    """`unscale-twice` from the state machine: an error where it explains a mismatch (1/S), a
    warning while every update matched."""
    evidence: Evidence = {"scale": o.scale, "window": o.window, "measured": 2, "expected": 1}
    message = "unscale_() called twice on the same optimizer in one step"
    severity, text = call_order_verdict(message, "unscale_ ran twice for one step",
                                        update_matched=o.update_matched,
                                        unmeasured=o.unmeasured)
    return unscale_twice(Observed(o.rung, severity, text, evidence=evidence,
                                  location=o.location))


@dataclass(frozen=True)
class UpdateWithoutStep:
    """scaler.update() with no optimizer step since the last one: the updates and scaler.step
    calls of the run. Its consequence is the scale trajectory (always an error)."""

    kind: ClassVar[KindId] = KindId.UPDATE_PER_MICROBATCH
    rung: str
    window: int
    scale: float | None
    updates: int
    scaler_steps: int
    location: Location | None = None


def update_without_step(o: UpdateWithoutStep) -> Finding:
    """`update-per-microbatch` from the state machine: the loss-scale trajectory differs, an
    error whether or not the updates matched so far (never a call order merely fragile)."""
    message = (f"scaler.update() ran {o.updates} times for {o.scaler_steps} scaler.step() "
               "calls: more than once per optimizer step.")
    return update_per_microbatch(Observed(
        o.rung, Severity.ERROR, message,
        evidence={"scale": o.scale, "window": o.window, "measured": o.updates,
                  "expected": o.scaler_steps, "updates": o.updates,
                  "scaler_steps": o.scaler_steps},
        location=o.location))





@dataclass(frozen=True)
class StepOnInjectedInf:
    """The skips rung's injected inf reached optimizer step(s) that bypassed scaler.step's inf
    check (`direct`: an optimizer.step() called directly)."""

    rung: str
    param_name: str | None
    injected_window: int
    steps: int                          # optimizer steps that consumed the inf
    direct: bool
    own_scaler: bool = True
    location: Location | None = None


def step_on_injected_inf(o: StepOnInjectedInf) -> Finding:
    """`missing-unscale`: an update on the injected inf, an error in a run whose own precision
    uses a GradScaler (`skip_severity`)."""
    return missing_unscale(Observed(o.rung,
        skip_severity(True, own_scaler=o.own_scaler),
        f"An inf was injected into {o.param_name}.grad in window {o.injected_window} and "
        f"{o.steps} optimizer step(s) consumed it: the step bypassed scaler.step's inf "
        "check" + (" (optimizer.step() called directly)." if o.direct else ".")
        + ("" if o.own_scaler else FORCED_FP16),
        evidence={"measured": o.steps, "expected": 0, "steps_on_nonfinite_gradients": o.steps},
        location=o.location))


@dataclass(frozen=True)
class DirectStepRefused:
    """optimizer.step() called directly, never scaler.step(): the step applied scaled gradients
    (`ratio` to the reference, when known) and torch then refused scaler.update()."""

    rung: str
    scale: float | None
    ratio: float | None
    error: str
    location: Location | None = None


def direct_step_refused(o: DirectStepRefused) -> Finding:
    """`missing-unscale` for a loop torch stopped: an error."""
    return missing_unscale(Observed(o.rung, Severity.ERROR,
        f"optimizer.step() was called directly, never scaler.step(): the step "
        f"applied gradients still multiplied by the loss scale {o.scale:g}"
        + (f" ({o.ratio:.6g}x the reference)" if o.ratio else "")
        + " without an inf check, and torch then refused scaler.update() ('No "
        "inf checks were recorded prior to update').",
        evidence={"measured": significant(o.ratio) if o.ratio else None,
                  "expected": 1.0, "scale": o.scale, "error": o.error},
        location=o.location))


@dataclass(frozen=True)
class UnscaleRefused:
    """torch refused a second unscale_() of one optimizer in one step: its message (quoted),
    and the earlier unscale_'s line when it is another than the refused one."""

    rung: str
    precision: str
    error: str
    first: Location | None = None
    first_is_refused: bool = False      # the earlier unscale_ stands on the refused line
    location: Location | None = None


def unscale_refused(o: UnscaleRefused) -> Finding:
    """`unscale-twice` from torch's own refusal: the loop stopped, an error."""
    first = o.first
    also = (f" The first call was at {first.file}:{first.line}; keep one of the two."
            if first is not None and not o.first_is_refused else "")
    evidence: Evidence = {"error": o.error, "measured": 2, "expected": 1,
                          "unscale_calls_in_step": 2}
    if first is not None:
        evidence["first_unscale"] = f"{first.file}:{first.line}"
    return unscale_twice(Observed(o.rung, Severity.ERROR,
        f"In the {o.precision} run torch refused a second unscale_() of "
        "the same optimizer in one step: the gradients would be divided by "
        f"the scale twice.{also}",
        evidence=evidence, location=o.location))


#: unscale-twice's consumption (1/S) when the backward ran on the plain loss: `scaled =
#: scaler.scale(loss)` went unused, so unscale_ divided gradients never multiplied by S.
UNSCALED_BACKWARD = (
    "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient = {label}: backward "
    "ran on the unscaled loss (the result of scaler.scale(loss){at} was never backpropagated), "
    "so unscale_ divided gradients that were never multiplied by the scale.")
UNSCALED_BACKWARD_FIX = ("Backpropagate the scaled loss: `scaler.scale(loss).backward()`, not "
                         "`loss.backward()` after `scaler.scale(loss)`.")
