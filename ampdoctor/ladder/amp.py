"""Rungs `bf16-no-scaler` and `fp16-scaler`: the user's loop under its own AMP switch.

ampdoctor never substitutes a scaler or an autocast: the loop runs with `run.precision` set and
does whatever it does. Both rungs check that AMP is fully on (half-open-amp), then compare each
optimizer step with the teacher-forced fp32 reference at the precision's tolerance. The fp16
rung also replays the events through the step state machine. A framework that ran another
precision than the rung asked of it (accelerate's fp32 for fp16 on a CPU, Lightning's
bf16-mixed for 16-mixed) makes the rung a skip that names what ran and where it was asked.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ..core import thresholds
from ..core.enums import RungId, Status
from ..core.findings import Finding, RungResult, conclude
from ..core.safetext import exc_text, safe_str
from ..judge import tolerance
from ..kinds.precision import (
    AutocastDtype,
    AutocastOff,
    Fp16WithoutScaler,
    ScalerInBf16,
    autocast_dtype,
    autocast_off,
    fp16_without_scaler,
    scaler_in_bf16,
)
from ..kinds.scaling import (
    DirectStepRefused,
    RefusedUpdate,
    direct_step_refused,
    refused_update_finding,
)
from ..probe.callsite import Site
from ..probe.events import (
    AutocastEntered,
    FrameworkPrecision,
    OptimizerStep,
    Scale,
    ScalerInit,
    ScalerStep,
    Update,
)
from ..rules.scale_state import (
    SCALE_TRAJECTORY_KINDS,
    call_order_finding,
    explain_with_calls,
    runtime_double_scaling,
    skipped_steps,
    step_ratio,
    violation_observations,
)
from ..rules.trainer_precision import forced_refusal
from ..session import Session, Trace
from .analysis import (
    compare_trace,
    location,
    loop_error_finding,
    scheduler_findings,
    script_amp,
    step_count_finding,
)
from .casts import engine_precision, loop_location, weight_cast_finding
from .series import scaler_series

AUTOCAST_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


AUTOCAST_TEXT = re.compile(r"\bautocast\b")


def _enabled_scalers(trace: Trace) -> list[ScalerInit] | list[Scale]:
    inits = [e for e in trace.events_of(ScalerInit) if e.enabled]
    scaled = [e for e in trace.events_of(Scale) if e.enabled]
    return inits or scaled


def half_open_findings(session: Session, trace: Trace, rung: str) -> list[Finding]:
    precision = trace.precision
    if engine_precision(trace) == precision:
        return []   # DeepSpeed's mixed precision: the module cast, fp32 masters, no autocast
    want = AUTOCAST_DTYPE_NAMES[precision]
    findings: list[Finding] = []
    autocasts = trace.events_of(AutocastEntered)
    on_device = [e for e in autocasts if e.device_type == session.device.type]
    enabled = [e for e in on_device if e.enabled]
    scalers = _enabled_scalers(trace)
    if not enabled:
        where = (location(on_device[0].site) if on_device
                 else loop_location(session, AUTOCAST_TEXT))
        findings.append(autocast_off(AutocastOff(rung, precision, want, session.device.type,
                                                 len(on_device), bool(scalers), location=where)))
    else:
        wrong = [e for e in enabled if e.dtype != want]
        if wrong:
            e = wrong[0]
            findings.append(autocast_dtype(AutocastDtype(rung, precision, want, e.dtype,
                                                         bool(scalers), location=location(e.site))))
    if precision == "bf16":
        scaler_in_bf16 = _scaler_in_bf16(session, scalers, rung)
        if scaler_in_bf16 is not None:
            findings.append(scaler_in_bf16)
    if precision == "fp16" and enabled and not scalers and not findings:
        e = enabled[0]
        inits = trace.events_of(ScalerInit)
        findings.append(fp16_without_scaler(Fp16WithoutScaler(
            rung, location=location(inits[0].site if inits else e.site))))
    return findings


def _scaler_in_bf16(session: Session, scalers: list[ScalerInit] | list[Scale],
                    rung: str) -> Finding | None:
    """A GradScaler left on in bf16 training: the bf16 run's own enabled scaler (a spec's loop,
    switched by `run.precision`), or, for a script -- whose bf16 run ampdoctor forced, scaler
    off -- the script as written: autocast(bfloat16) only, with a GradScaler it enables (what its
    fp32 run recorded before anything was forced)."""
    own = script_amp(session)
    if own is None:
        if not scalers:
            return None
        scaler = scalers[0]
        site, scale = scaler.site, (getattr(scaler, "init_scale", None)
                                    or getattr(scaler, "scale", None))
    else:
        if own.dtypes != {"bfloat16"} or not own.scalers:
            return None   # an fp16 (or fp32) script needs (or wastes nothing on) its scaler
        site, scale = own.scalers[0].get("site"), own.scalers[0].get("init_scale")
    return scaler_in_bf16(ScalerInBf16(rung, scale, in_script=own is not None,
                                       location=location(site)))


def _map_loop_error(session: Session, trace: Trace, rung: str) -> Finding:
    exc = trace.error
    assert exc is not None   # (the loop raised)
    refused_update = (isinstance(exc, AssertionError)
                      and "No inf checks were recorded" in safe_str(exc))
    direct = [e for e in trace.events_of(OptimizerStep) if not e.via_scaler]
    if refused_update and direct and not trace.events_of(ScalerStep):
        # optimizer.step() instead of scaler.step(): nothing recorded an inf check, so torch
        # refused the update -- the step itself already applied scaled gradients.
        first = direct[0]
        ratio = step_ratio(session, trace, first)
        scale = next((e.scale for e in trace.events_of(Scale) if e.scale), None)
        return direct_step_refused(DirectStepRefused(rung, scale, ratio, exc_text(exc),
                                                     location=location(first.site)))
    if refused_update:
        updates = [e for e in trace.events_of(Update) if e.error is not None]
        site: Site | None = updates[-1].site if updates else trace.error_site
        last_step = max((e.seq for e in trace.events_of(ScalerStep)), default=-1)
        early = [e for e in trace.events_of(Update) if e.seq > last_step]
        return refused_update_finding(RefusedUpdate(
            rung, len(early), exc_text(exc),
            microbatch=trace.events[-1].microbatch if trace.events else None,
            location=location(site)))
    return loop_error_finding(trace, rung)


#: torch's own "this op has no kernel for this dtype on this device" errors: a limit of the
#: backend (oneDNN LSTM in bf16 on CPU, an op without a Half kernel), not of the user's loop.
_BACKEND_LIMITS = re.compile(r"not implemented for '(BFloat16|Half)'|could not create a "
                             r"primitive|onednn|mkldnn|no kernel", re.IGNORECASE)


def framework_change(trace: Trace) -> tuple[str, dict[str, Any]] | None:
    """Why the rung did not test its precision when a framework ran another one (a skip
    reason and the record's details), or None."""
    for event in trace.events_of(FrameworkPrecision):
        if not event.reason or event.ran == trace.precision:
            continue
        asked_at = (f" (asked at {os.path.basename(event.site.file)}:{event.site.line})"
                    if event.site is not None else "")
        ran = event.ran or "a mode without a rung"
        reason = (f"{event.framework} refused the {trace.precision} this rung asked for"
                  f"{asked_at}: {event.reason}; {trace.precision} was not tested here"
                  if event.refused else
                  f"{event.framework} ran {ran}, not the {trace.precision} this rung asked for"
                  f"{asked_at}: {event.reason}; {trace.precision} was not tested here")
        details = {"framework": event.framework, "precision_asked": event.asked,
                   "precision_ran": event.ran,
                   "asked_at": (f"{event.site.file}:{event.site.line}"
                                if event.site is not None else None)}
        return reason, details
    return None


def _backend_cannot(session: Session, trace: Trace) -> bool:
    exc = trace.error
    if not isinstance(exc, (RuntimeError, NotImplementedError)):
        return False
    fp32 = session.traces.get("fp32")
    if fp32 is None or fp32.error is not None:   # it must run in fp32 to blame the dtype
        return False
    return bool(_BACKEND_LIMITS.search(safe_str(exc)))


def _cannot_run_here(session: Session, trace: Trace, rung: RungId,
                     details: dict[str, Any]) -> RungResult | None:
    """A skip when the run raised because this device cannot run the precision: a framework
    that refused it (DeepSpeed's "Type fp16 is not supported on your device"), or torch's
    backend without the kernel; None otherwise (the loop's own error is judged)."""
    if trace.error is None:
        return None
    pinned = forced_refusal(trace.error, safe_str(trace.error), trace.precision,
                            session.spec.precisions)
    if pinned is not None:
        return RungResult(rung, Status.SKIP, pinned, details=details)
    changed = framework_change(trace)
    if changed is not None and changed[1]["precision_ran"] is None:
        details["framework_precision"] = changed[1]
        return RungResult(rung, Status.SKIP, changed[0], details=details)
    if _backend_cannot(session, trace):
        first = (safe_str(trace.error).splitlines() or [''])[0][:160]
        return RungResult(rung, Status.SKIP, f"torch on {session.device.type} cannot run this "
                          f"model in {trace.precision}: {first}",
                          details=details)
    return None


def run_precision(session: Session, precision: str, rung: RungId) -> RungResult:
    trace = session.trace(precision)
    details: dict[str, Any] = {}
    if precision == "fp16":
        # the record's fp16 `series`: the run's scale after every update that recorded one
        series = scaler_series(trace)
        series["scale"] = [v for v in series["scale"] if v is not None]
        details["series"] = series
    cast = weight_cast_finding(session, trace, rung)
    if cast is not None:   # explains an error it caused (GradScaler refusing fp16 gradients)
        return RungResult(rung, Status.FAIL, f"the {precision} loop casts the model's weights to "
                          f"{cast.evidence['measured']} ({cast.kind})", [cast], details=details)
    cannot = _cannot_run_here(session, trace, rung, details)
    if cannot is not None:
        return cannot
    if trace.error is not None:
        finding = _map_loop_error(session, trace, rung)
        return RungResult(rung, Status.FAIL, f"the {precision} loop raised ({finding.kind})",
                          [finding], details=details)
    changed = framework_change(trace)
    if changed is not None:
        reason, framework = changed
        details["framework_precision"] = framework
        return RungResult(rung, Status.SKIP, reason, details=details)
    findings = half_open_findings(session, trace, rung)
    if any(f.severity == "error" for f in findings):
        return conclude(rung, findings, "", details)
    if precision == "fp16":
        # An update-per-microbatch or a second loss scale shows in the scale trajectory itself
        # (the consequence this rung judges besides the gradient).
        violations = violation_observations(session, trace, rung)
        trajectory = [call_order_finding(v) for v in violations
                      if v.kind in SCALE_TRAJECTORY_KINDS]
        double = runtime_double_scaling(session.trace("fp32"), trace, rung)
        if double is not None:
            trajectory.append(double)
        if trajectory:
            return conclude(rung, findings + trajectory, "", details)
    findings += scheduler_findings(session, trace, rung)
    skipped = skipped_steps(trace)
    count = step_count_finding(session, trace, rung, skipped_windows=skipped)
    if count is not None:
        return conclude(rung, findings + [count], "", details)
    mismatch, judgement = compare_trace(session, trace, rung, precision)
    comparisons = judgement.steps
    if precision == "fp16":
        mismatch, fragile = explain_with_calls(mismatch, violations, judgement)
        findings += fragile
    findings += mismatch
    worst = max((c.metrics.rel_err for c in comparisons), default=0.0)
    tol = tolerance(session, precision)
    details.update({"max_relative_error": worst, "tolerance": tol.rtol,
                    "steps_compared": len(comparisons), "skipped_steps": skipped})
    ok = (f"{len(comparisons)} optimizer steps match the reference within {precision} tolerance "
          f"(max relative error {worst:.3g}, tolerance {tol.rtol:g})")
    if worst > tol.rtol:
        low, high = thresholds.NOISE_RATIO_BAND
        ok = (f"{len(comparisons)} optimizer steps match the reference up to {precision} rounding "
              f"(max relative error {worst:.3g} > tolerance {tol.rtol:g}, but same direction and "
              f"size: cosine >= {thresholds.NOISE_MIN_COSINE:g}, norm ratio within "
              f"{low:g}-{high:g})")
    if skipped:
        ok += f"; {skipped} step(s) skipped by the scaler"
    if not comparisons and skipped and not findings:
        # Nothing was compared: a pass would claim what was never checked.
        return RungResult(rung, Status.SKIP, f"every optimizer step ({skipped}) was skipped by the "
                          "scaler for overflow: no update to compare (see the skips rung)",
                          details=details)
    return conclude(rung, findings, ok, details)


def bf16_supported(session: Session) -> str | None:
    """None when bf16 autocast can run here, else the reason it cannot."""
    if session.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name(session.device)} has no bf16 support"
    return None


def run_bf16(session: Session) -> RungResult:
    reason = bf16_supported(session)
    if reason:
        return RungResult(RungId.BF16_NO_SCALER, Status.SKIP, reason)
    return run_precision(session, "bf16", RungId.BF16_NO_SCALER)


def run_fp16(session: Session) -> RungResult:
    return run_precision(session, "fp16", RungId.FP16_SCALER)
