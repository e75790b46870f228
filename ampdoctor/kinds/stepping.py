"""The kinds of when the optimizer steps and its gradients are cleared: `step-per-microbatch`,
`zero-grad-inside-accumulation`, `missing-zero-grad`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.enums import KindId, Severity
from ..core.evidence import Evidence, significant
from ..core.findings import Finding, Location
from .base import SCAN_RUNG, AccumulationLoop, Kind, Observed, in_framework_terms
from .mismatch import gradient_mismatch

STEP_PER_MICROBATCH = Kind(
    KindId.STEP_PER_MICROBATCH,
    title="The optimizer steps on every micro-batch",
    why=(
        "The optimizer steps K times per window instead of once: each update uses one micro-batch, "
        "the effective batch is b instead of K*b and the scheduler and scaler run K times too "
        "fast."),
    fix=(
        "Put the whole step under the window condition: `if (i + 1) % accumulation_steps == 0:` "
        "then `scaler.unscale_(opt)`, clip, `scaler.step(opt)`, `scaler.update()`, "
        "`opt.zero_grad()`."),
    example=(
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    scaler.step(optimizer)                # every micro-batch\n"
        "    scaler.update()\n"
        "    if (i + 1) % K == 0:\n"
        "        optimizer.zero_grad()"),
    error_when=(
        "the optimizer stepped more often than there are windows: each update applied part of "
        "a window, and the parameters follow another trajectory than the reference's."),
    measured="optimizer steps for the run's windows",
    decided_in=f"{__name__}:step_per_microbatch",
    framework_fixes={
        "HF Trainer":
            "Let the Trainer step: it steps once per gradient_accumulation_steps batches; remove "
            "any `optimizer.step()` from `compute_loss`, a `training_step` override or a callback.",
        "accelerate":
            "Hand the optimizer to `accelerator.prepare` and call it inside `with "
            "accelerator.accumulate(model):` with `Accelerator(gradient_accumulation_steps=K)`: "
            "the prepared optimizer steps only when `accelerator.sync_gradients` is true.",
        "Lightning":
            "In manual optimization step under the window condition: `if (batch_idx + 1) % N == "
            "0: opt.step(); opt.zero_grad()` (or let automatic optimization step with "
            "`Trainer(accumulate_grad_batches=N)`).",
        "Fabric":
            "Step only at the window's end: `if not is_accumulating: optimizer.step(); "
            "optimizer.zero_grad()`, with `is_accumulating = (i + 1) % K != 0`.",
    },
)


ZERO_GRAD_INSIDE_ACCUMULATION = Kind(
    KindId.ZERO_GRAD_INSIDE_ACCUMULATION,
    title="Gradients are zeroed inside the accumulation window",
    why=(
        "`zero_grad` runs before the window is complete, so only the last micro-batch(es) reach "
        "the "
        "optimizer step; the other K-1 are thrown away."),
    fix=(
        "Call `optimizer.zero_grad(set_to_none=True)` once per window, right after "
        "`scaler.update()` (or before the window's first micro-batch: `if i % K == 0:`), never "
        "between the micro-batches of a window."),
    example=(
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    optimizer.zero_grad()                 # wipes the window so far\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    if (i + 1) % K == 0:\n"
        "        scaler.step(optimizer); scaler.update()"),
    error_when=(
        "a step's update differs from the reference and only the micro-batches after a "
        "zero_grad inside the window reached it."),
    measured="micro-batches of the window that reached the step",
    decided_in=f"{__name__}:zero_grad_inside_accumulation",
    matched=(
        "Step {step}: the optimizer consumed {label} (norm ratio {ratio:.4g}, cosine "
        "{cos:.5f}): gradients were cleared inside the window."),
    framework_fixes={
        "HF Trainer":
            "Remove `zero_grad()` from `compute_loss`, a `training_step` override or a callback: "
            "the Trainer clears the gradients after each optimizer step.",
        "accelerate":
            "Call `optimizer.zero_grad()` on the prepared optimizer inside `accelerator.accumulate("
            "model)` (it clears only when `sync_gradients` is true), never on the raw optimizer or "
            "the model between micro-batches.",
        "Lightning":
            "In manual optimization call `opt.zero_grad()` only under `if (batch_idx + 1) % N == "
            "0:`, after `opt.step()`.",
        "Fabric":
            "Call `optimizer.zero_grad()` only after the window's `optimizer.step()` (`if not "
            "is_accumulating:`).",
    },
)


MISSING_ZERO_GRAD = Kind(
    KindId.MISSING_ZERO_GRAD,
    title="Gradients are carried from one optimizer step into the next",
    why=(
        "`.grad` is not cleared after an optimizer step (no `zero_grad`, or one that covers only "
        "part of the model), so every step re-applies the gradients of the windows before it: "
        "the effective learning rate grows with every step, and an overflow, once in `.grad`, "
        "poisons every later window."),
    fix=(
        "Clear every parameter's gradient once per optimizer step, right after the step (skipped "
        "or not): `optimizer.zero_grad(set_to_none=True)` on every optimizer, or "
        "`model.zero_grad()`."),
    example=(
        "if (i + 1) % K == 0:\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
        "    head.zero_grad()      # clears the head only (or no zero_grad at all)"),
    error_when=(
        "a step consumed its window's gradient plus an earlier window's: the update differs."),
    measured="parameters whose .grad carried over a step",
    decided_in=f"{__name__}:missing_zero_grad",
)


def step_per_microbatch(seen: Observed) -> Finding:
    """`step-per-microbatch`: the optimizer steps on every micro-batch.
    Error: more optimizer steps than windows (another parameter trajectory).
    (`STEP_PER_MICROBATCH.error_when`)"""
    seen = in_framework_terms(STEP_PER_MICROBATCH, seen)
    return Finding(seen.rung, KindId.STEP_PER_MICROBATCH, seen.severity,
                   **seen.fields(STEP_PER_MICROBATCH))


def zero_grad_inside_accumulation(seen: Observed) -> Finding:
    """`zero-grad-inside-accumulation`: gradients are zeroed inside the accumulation window.
    Error: an update off the reference, only the micro-batches after the zero_grad in it.
    (`ZERO_GRAD_INSIDE_ACCUMULATION.error_when`)"""
    seen = in_framework_terms(ZERO_GRAD_INSIDE_ACCUMULATION, seen)
    return Finding(seen.rung, KindId.ZERO_GRAD_INSIDE_ACCUMULATION, seen.severity,
                   **seen.fields(ZERO_GRAD_INSIDE_ACCUMULATION))


def missing_zero_grad(seen: Observed) -> Finding:
    """`missing-zero-grad`: gradients are carried from one optimizer step into the next.
    Error: a step consumed an earlier window's gradient too. (`MISSING_ZERO_GRAD.error_when`)"""
    return Finding(seen.rung, KindId.MISSING_ZERO_GRAD, seen.severity,
                   **seen.fields(MISSING_ZERO_GRAD))


# --- what the count of optimizer steps says (rules/counts.py) ---------------------------------


@dataclass(frozen=True)
class EngineContext:
    """What a DeepSpeed engine adds to a count: its sentence (why the engine stepped), the
    line to point at, its fix, and its config's gradient_accumulation_steps."""

    sentence: str
    location: Location | None = None
    fix: str = ""
    config_value: int | None = None


@dataclass(frozen=True)
class StepsPerWindow:
    """One optimizer stepped more often than there are windows: its steps, the windows (N) of
    K micro-batches, the micro-batches before its first step, and the windows the scaler
    skipped (no step expected there)."""

    rung: str
    precision: str
    optimizer: int
    steps: int
    windows: int
    K: int
    microbatches_before_first_step: int
    skipped_windows: int = 0
    framework: str | None = None
    engine: EngineContext | None = None
    location: Location | None = None


def steps_per_window(o: StepsPerWindow) -> Finding:
    """`step-per-microbatch`: more optimizer steps than windows, each update a fraction of one
    (an error: another parameter trajectory than the reference's)."""
    per_window = o.steps / o.windows
    engine = o.engine
    evidence: Evidence = {"measured": o.steps, "expected": o.windows - o.skipped_windows,
                          "steps_per_window": round(per_window, 6),
                          "microbatches_before_first_step": o.microbatches_before_first_step,
                          "optimizer": o.optimizer}
    if o.framework:
        evidence["framework"] = o.framework
    if engine is not None and engine.config_value is not None:
        evidence["config_gradient_accumulation_steps"] = engine.config_value
    return step_per_microbatch(Observed(o.rung, Severity.ERROR,
        f"The optimizer stepped {o.steps} times for {o.windows} windows of "
        f"K={o.K} micro-batches in the {o.precision} run "
        f"({per_window:.3g} steps per window; the first step came after "
        f"{o.microbatches_before_first_step} micro-batch(es)). Each update used a fraction of "
        "the window." + (f" {engine.sentence}" if engine is not None else ""),
        evidence=evidence,
        location=(engine.location if engine is not None and engine.location else o.location),
        fix=engine.fix if engine is not None else ""))


# --- a zero_grad inside the window ------------------------------------------------------------


@dataclass(frozen=True)
class ZeroedInside:
    """A zero_grad between the backwards of one window: the micro-batches after it that
    reached the step out of the window's. With `comparison` (the judge's comparison keys of
    the step) the update was measured against the reference; without, only the trace was
    read (a script run with no reference)."""

    rung: str
    contributing: int
    microbatches: int                   # the window's (K)
    step: int | None = None             # the judged step's ordinal
    ratio: float | None = None          # consumed / reference norm (before a clip)
    cosine: float | None = None
    clipped: bool = False
    comparison: Evidence | None = None
    fix: str = ""                       # a DeepSpeed engine's own terms, when one drove it
    forced_clip: float | None = None
    location: Location | None = None
    #: (window, its micro-batches): an epoch's last, short window no step consumed, which the
    #: step was judged against; the zero_grad cleared all of it (`contributing` is 0)
    unstepped: tuple[int, int] | None = None


UNSTEPPED_FIX = (
    "Step on the epoch's last micro-batch too, so its short window gets its update before the "
    "next epoch's zero_grad: `if (i + 1) % K == 0 or i + 1 == len(loader):` (dividing its loss "
    "by K as in every window, or by the window's own count of micro-batches).")


def zeroed_inside(o: ZeroedInside) -> Finding:
    """`zero-grad-inside-accumulation`: an error when the update was compared and only the
    micro-batches after the zero_grad reached it; a warning when no reference measured it."""
    if o.comparison is None or o.ratio is None or o.cosine is None:
        return zero_grad_inside_accumulation(Observed(o.rung, Severity.WARNING,
            f"zero_grad ran between the backwards of one window: only the last "
            f"{o.contributing} of its {o.microbatches} micro-batches reach the optimizer step. "
            "(No reference was run, so the update itself was not compared.)",
            evidence={"measured": o.contributing, "expected": o.microbatches,
                      "contributing_microbatches": o.contributing},
            location=o.location))
    evidence: Evidence = {**o.comparison, "measured": o.contributing,
                          "expected": o.microbatches, "contributing_microbatches": o.contributing,
                          "norm_ratio": significant(o.ratio)}
    if o.unstepped is not None:
        window, size = o.unstepped
        evidence.update({"measured": 0, "expected": size, "contributing_microbatches": 0,
                         "window": window, "window_microbatches": size})
        return zero_grad_inside_accumulation(Observed(o.rung, Severity.ERROR,
            f"Window {window}, an epoch's last, short window of {size} micro-batch(es) (K="
            f"{o.microbatches}), never reached an optimizer step: zero_grad cleared its "
            f"gradient, so none of its {size} micro-batch(es) trained the model, and step "
            f"{o.step} consumed the micro-batches after it (gradient norm ratio {o.ratio:.4g} "
            f"to window {window}'s reference, cosine {o.cosine:.4f}).",
            evidence=evidence, location=o.location, fix=o.fix or UNSTEPPED_FIX,
            forced_clip=o.forced_clip))
    return zero_grad_inside_accumulation(Observed(o.rung, Severity.ERROR,
        f"Step {o.step}: zero_grad ran inside the accumulation window, "
        f"so only {o.contributing} of {o.microbatches} micro-batches reached the optimizer step "
        f"({'before clipping, ' if o.clipped else ''}gradient norm "
        f"ratio {o.ratio:.4g} to the reference, cosine {o.cosine:.4f}).",
        evidence=evidence, location=o.location, fix=o.fix, forced_clip=o.forced_clip))


@dataclass(frozen=True)
class CarriedOver:
    """A step that consumed its window's reference gradient plus what the previous step
    already applied: the parameters whose .grad was not cleared (their first names), of the
    step's parameters."""

    rung: str
    step: int
    carried: tuple[str, ...]
    parameters: int
    ratio: float
    comparison: Evidence
    forced_clip: float | None = None
    location: Location | None = None


def carried_over(o: CarriedOver) -> Finding:
    """`missing-zero-grad`: the update differs by an earlier window's gradient (an error)."""
    partial = len(o.carried) < o.parameters
    evidence: Evidence = {**o.comparison, "measured": len(o.carried), "expected": 0,
                          "parameters_not_cleared": len(o.carried), "parameters": o.parameters,
                          "norm_ratio": significant(o.ratio)}
    which = (f"{len(o.carried)} of {o.parameters} parameters ({', '.join(o.carried[:4])}"
             + (", ..." if len(o.carried) > 4 else "") + ")") if partial else "every parameter"
    return missing_zero_grad(Observed(o.rung, Severity.ERROR,
        f"Step {o.step}: for {which} the optimizer consumed this window's "
        f"reference gradient plus what step {o.step - 1} already applied: .grad "
        "is not cleared after an optimizer step"
        + (" (the zero_grad call covers only part of the model)" if partial else "")
        + ", so every step re-applies earlier windows, and an overflow, once in "
        ".grad, poisons every later window. Clear all gradients after each step, "
        "skipped or not.",
        evidence=evidence, location=o.location, forced_clip=o.forced_clip))


# --- what the sentinel counted in a real training ---------------------------------------------


@dataclass(frozen=True)
class OneBackwardPerStep:
    """The sentinel's first windows: each optimizer step consumed the gradient of one backward
    where K were meant."""

    rung: str
    K: int
    windows: int
    backwards_per_step: tuple[int, ...]
    location: Location | None = None


def one_backward_per_step(o: OneBackwardPerStep) -> Finding:
    """`step-per-microbatch` in a real training: K times as many updates, each on 1/K of the
    data (an error)."""
    return step_per_microbatch(Observed(o.rung, Severity.ERROR,
        f"Each of the first {o.windows} optimizer steps consumed the gradient of one "
        f"backward where K={o.K} were meant: the optimizer steps every micro-batch, "
        f"{o.K}x as many updates each on 1/{o.K} of the data.",
        evidence={"measured": 1, "expected": o.K, "accumulation_steps": o.K,
                  "backwards_per_step": list(o.backwards_per_step)},
        location=o.location))


@dataclass(frozen=True)
class ZeroedInWindow:
    """The sentinel saw a zero_grad after `zeroed_after` of a window's backwards."""

    rung: str
    step: int
    K: int
    backwards: int
    zeroed_after: int | None
    location: Location | None = None


def zeroed_in_window(o: ZeroedInWindow) -> Finding:
    """`zero-grad-inside-accumulation` in a real training: the earlier micro-batches were
    thrown away (an error)."""
    kept = o.backwards - (o.zeroed_after or 0)
    return zero_grad_inside_accumulation(Observed(o.rung, Severity.ERROR,
        f"Optimizer step {o.step}: zero_grad ran after {o.zeroed_after} of the "
        f"window's {o.backwards} backwards, so the step consumed the gradient of only the "
        f"last {kept} micro-batch(es): the earlier ones were thrown away.",
        evidence={"measured": kept, "expected": o.backwards, "accumulation_steps": o.K,
                  "step": o.step},
        location=o.location))


# --- the static scan: zero_grad on every iteration of an accumulation loop --------------------


@dataclass(frozen=True)
class ZeroGradInLoop:
    """`code` (a `.zero_grad()`, at `line`) runs on every iteration of `loop`."""

    line: int
    code: str
    loop: AccumulationLoop
    location: Location | None = None


def zero_grad_in_loop(o: ZeroGradInLoop) -> Finding:
    """`zero-grad-inside-accumulation` read in the code: a warning (a pattern)."""
    return zero_grad_inside_accumulation(Observed(SCAN_RUNG, Severity.WARNING,
        f"`{o.code}` at line {o.line} runs on every micro-batch {o.loop.context()}: it wipes the "
        "gradients the window's earlier micro-batches accumulated, so the optimizer step sees "
        "only the last one.", evidence=o.loop.evidence(), location=o.location,
        title="zero_grad() on every micro-batch of the accumulation window"))


# --- an epoch's last, short window that no step consumed ----------------------------------


@dataclass(frozen=True)
class CarriedShortWindow:
    """A step whose gradient is the micro-batches of an epoch's last, short window that no step
    consumed and no zero_grad cleared, plus those of the window after it, each at 1/K: the
    short window `window` of `size` micro-batches, `consumed` in all, the comparison with the
    short window's own reference."""

    rung: str
    step: int
    window: int
    size: int
    consumed: int
    K: int
    ratio: float
    cosine: float
    comparison: Evidence
    forced_clip: float | None = None
    location: Location | None = None


def carried_short_window(o: CarriedShortWindow) -> Finding:
    """`gradient-mismatch`: a short window's gradient carried into the next window's step (an
    error: its window's update never happens and the next one holds more than K micro-batches)."""
    evidence: Evidence = {**o.comparison, "window_microbatches": o.size,
                          "contributing_microbatches": o.consumed}
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"Window {o.window}, an epoch's last, short window of {o.size} micro-batch(es) (K="
        f"{o.K}), never reached an optimizer step, and nothing cleared its gradient: step "
        f"{o.step} consumed it together with the next window's, {o.consumed} micro-batches "
        f"each divided by K (it matches the two windows' references summed that way; norm "
        f"ratio {o.ratio:.4g}, cosine {o.cosine:.4f} to window {o.window}'s).",
        evidence=evidence, location=o.location, fix=UNSTEPPED_FIX,
        forced_clip=o.forced_clip))
