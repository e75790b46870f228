"""Rungs `bf16-no-scaler` and `fp16-scaler`: the user's loop under its own AMP switch.

ampdoctor never substitutes a scaler or an autocast: the loop runs with `run.precision` set and
does whatever it does. Both rungs check that AMP is fully on (half-open-amp), then compare each
optimizer step with the teacher-forced fp32 reference at the precision's tolerance. The fp16
rung also replays the events through the step state machine (article §16).
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import torch

from .. import compare
from ..findings import Finding, Location, RungResult, conclude
from ..probe.callsite import Site
from ..probe.recorder import Event
from ..probe.statemachine import StepStateMachine
from ..session import Session, Trace, flat
from ..judge import tolerance
from .analysis import (compare_trace, location, loop_error_finding, scheduler_findings,
                       step_count_finding)

AUTOCAST_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


AUTOCAST_TEXT = re.compile(r"\bautocast\b")


def _loop_location(session: Session, pattern: re.Pattern | None = None) -> Location | None:
    """The loop's `def` line, or the first line of the loop that matches `pattern` (where the
    loop sets up what it never used: an autocast it never enters)."""
    try:
        fn = inspect.unwrap(session.code.train_loop)
        file = inspect.getsourcefile(fn)
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    if not file:
        return None
    name = getattr(fn, "__name__", None)
    if pattern is not None:
        for offset, text in enumerate(lines):
            code = text.split("#", 1)[0]
            if pattern.search(code):
                return Location(str(file), start + offset, name, text.strip())
    return Location(str(file), start, name, None)


def _enabled_scalers(trace: Trace) -> list[Event]:
    inits = [e for e in trace.of_kind("scaler_init") if e.data.get("enabled")]
    scaled = [e for e in trace.of_kind("scale") if e.data.get("enabled")]
    return inits or scaled


def half_open_findings(session: Session, trace: Trace, rung: str) -> list[Finding]:
    precision = trace.precision
    want = AUTOCAST_DTYPE_NAMES[precision]
    findings: list[Finding] = []
    autocasts = trace.of_kind("autocast")
    on_device = [e for e in autocasts if e.data.get("device_type") == session.device.type]
    enabled = [e for e in on_device if e.data.get("enabled")]
    scalers = _enabled_scalers(trace)
    if not enabled:
        where = (location(on_device[0].site) if on_device
                 else _loop_location(session, AUTOCAST_TEXT))
        seen = (f"autocast was entered {len(on_device)} time(s) but never enabled"
                if on_device else "autocast was never entered")
        findings.append(Finding(
            rung, "half-open-amp", "error",
            f"The {precision} run asked for autocast({want}) but {seen} on "
            f"{session.device.type}: every forward ran in fp32, so this 'mixed precision' run "
            "is really fp32" + (" with a loss scaler on top." if scalers else "."),
            evidence={"measured": 0, "expected": 1, "autocast_entered": len(on_device),
                      "autocast_enabled": 0, "scaler_enabled": bool(scalers)},
            location=where))
    else:
        wrong = [e for e in enabled if e.data.get("dtype") != want]
        if wrong:
            e = wrong[0]
            findings.append(Finding(
                rung, "half-open-amp", "error",
                f"The {precision} run entered autocast with dtype {e.data.get('dtype')}, not "
                f"{want}: the loop ignores run.autocast_dtype"
                + (" and runs fp16 without the scaler it needs." if e.data.get("dtype") == "float16"
                   and not scalers else "."),
                evidence={"measured": e.data.get("dtype"), "expected": want},
                location=location(e.site)))
    if precision == "bf16" and scalers:
        e = scalers[0]
        findings.append(Finding(
            rung, "half-open-amp", "warning",
            "A GradScaler is enabled in the bf16 run. bf16 has fp32's exponent range and needs no "
            "loss scaling: the scaler only multiplies and divides, and its skipped steps hide real "
            "overflow. Enable it for fp16 only.",
            evidence={"measured": "enabled", "expected": "disabled",
                      "scale": e.data.get("init_scale", e.data.get("scale"))},
            location=location(e.site)))
    if precision == "fp16" and enabled and not scalers and not findings:
        e = enabled[0]
        inits = trace.of_kind("scaler_init")
        findings.append(Finding(
            rung, "half-open-amp", "error",
            "The fp16 run enters autocast(float16) but no enabled GradScaler scales the loss: "
            "small fp16 gradients underflow to zero and overflow is never detected.",
            evidence={"measured": "no enabled scaler", "expected": "GradScaler enabled"},
            location=location(inits[0].site if inits else e.site)))
    return findings


def _series(trace: Trace) -> dict[str, list[Any]]:
    unscales = [e for e in trace.of_kind("unscale") if e.data.get("enabled")]
    return {
        "scale": [e.data.get("scale_after") for e in trace.of_kind("update")
                  if e.data.get("scale_after") is not None],
        "grad_norm_before_unscale": [e.data.get("norm_before") for e in unscales],
        "grad_norm_after_unscale": [e.data.get("norm_after") for e in unscales],
        "skipped": [bool(e.data.get("skipped")) for e in trace.of_kind("scaler_step")],
    }


def _state_for_window(session: Session, trace: Trace, window: int):
    for ordinal, step in enumerate(trace.steps):
        if session.window_of(step, ordinal, trace) == window:
            snap = trace.probe.snapshots.get(step.group)
            if snap is not None:
                return snap.state, snap.training
    if window == 0:
        return session.initial_state, True
    return None


def _reference_norm(session: Session, trace: Trace, window: int, names: list[str] | None = None):
    found = _state_for_window(session, trace, window)
    if found is None:
        return None
    ref = session.reference(window, found[0], found[1], per_mb=False)
    return float(torch.linalg.vector_norm(flat(session, ref.full, names or session.param_order)))


def _last_scale_before(trace: Trace, seq: int) -> float | None:
    scales = [e.data.get("scale") for e in trace.events if e.kind == "scale" and e.seq < seq
              and e.data.get("scale")]
    return scales[-1] if scales else None


def violation_findings(session: Session, trace: Trace, rung: str) -> list[Finding]:
    owner = {id(p): slot for slot, opt in enumerate(trace.probe.optimizers)
             for group in opt.param_groups for p in group["params"]}
    machine = StepStateMachine(owner)
    violations = machine.feed_all(trace.events)
    findings: list[Finding] = []
    seen: set[str] = set()
    for v in violations:
        if v.kind in seen:
            continue
        seen.add(v.kind)
        event = v.event
        window = min(trace.window_of_event(event) or 0, session.N - 1)
        scale = _last_scale_before(trace, event.seq)
        evidence: dict[str, Any] = {"scale": scale, "window": window}
        if v.kind == "clip-before-unscale":
            seen_norm = v.data.get("total_norm")
            true_norm = _reference_norm(session, trace, window)
            ratio = (seen_norm / true_norm) if seen_norm and true_norm else None
            by_value = event.data.get("kind") == "value"
            if by_value:
                # clip_grad_value_ returns nothing: the threshold is off by the scale itself.
                ratio = scale
            evidence.update({"measured": compare._round(ratio) if ratio else None,
                             "expected": 1.0, "norm_seen_by_clip": seen_norm,
                             "true_norm": compare._round(true_norm) if true_norm else None,
                             "max_grad_norm": v.data.get("max_norm")})
            if by_value:
                message = (f"clip_grad_value_ ran before scaler.unscale_: the clip value "
                           f"{v.data.get('max_norm')} was applied to gradients multiplied by the "
                           f"loss scale {scale:g}, i.e. a clip value {scale:g}x too small in "
                           "true-gradient space.")
            elif ratio and seen_norm and true_norm:
                message = (f"clip_grad_norm_ ran before scaler.unscale_: it saw a gradient norm "
                           f"of {seen_norm:.6g} where the true norm is {true_norm:.6g} — a ratio "
                           f"of {ratio:.6g}, the loss scale ({scale:g}). The threshold "
                           f"{v.data.get('max_norm')} was applied in scaled space.")
            else:
                message = "clip_grad_norm_ ran before scaler.unscale_ on scaled gradients."
            slot = v.data.get("optimizer")
            if len(trace.probe.optimizers) > 1 and slot is not None:
                evidence["optimizer"] = slot
                unscaled = sorted({e.optimizer for e in trace.events
                                   if e.kind == "unscale" and e.seq < event.seq
                                   and e.optimizer is not None and e.optimizer != slot})
                message += (f" Optimizer {slot} (of {len(trace.probe.optimizers)}) had not been "
                            "unscaled" + (f" although optimizer(s) {unscaled} had: the clip "
                                          "mixed scaled and true gradients" if unscaled else "")
                            + f"; call scaler.unscale_() on optimizer {slot} before clipping.")
        elif v.kind == "missing-unscale":
            slot = v.data.get("optimizer")
            ratio = _step_ratio(session, trace, event)
            evidence.update({"measured": compare._round(ratio) if ratio else None,
                             "expected": 1.0, "optimizer": slot})
            message = (f"Optimizer {slot} stepped with its own .step() on gradients still "
                       f"multiplied by the loss scale {scale:g}"
                       + (f": its gradient is {ratio:.6g}x the reference." if ratio else ".")
                       + " scaler.step() was bypassed, so it was never unscaled nor checked for "
                         "inf.")
        elif v.kind == "update-per-microbatch":
            updates = len(trace.of_kind("update"))
            steps = len(trace.of_kind("scaler_step"))
            evidence.update({"measured": updates, "expected": steps,
                             "updates": updates, "scaler_steps": steps})
            message = (f"scaler.update() ran {updates} times for {steps} scaler.step() calls: "
                       "more than once per optimizer step.")
        elif v.kind == "double-scaling":
            first = v.data.get("first_scale") or 0
            evidence.update({"measured": compare._round(first * (scale or 1)),
                             "expected": scale, "skipped_steps": _skipped(trace)})
            message = (f"scaler.scale() was applied to a loss that was already scaled by "
                       f"{first:g}: the effective loss scale is {first * (scale or 1):.6g}, not "
                       f"{scale:g}.")
        else:
            evidence.update({"measured": 2, "expected": 1})
            message = v.detail
        findings.append(Finding(rung, v.kind, "error", message, evidence=evidence,
                                location=location(event.site)))
    return findings


#: State-machine findings whose consequence is the loss-scale trajectory, judged here directly.
SCALE_TRAJECTORY_KINDS = ("update-per-microbatch", "double-scaling")

#: Why a call order whose update matched this run is still fragile.
_FRAGILE = {
    "clip-before-unscale": "it clipped gradients still multiplied by the loss scale; it has not "
                           "bitten yet, but once the scale grows (or the gradients do) the "
                           "threshold acts on S x the true norm and the update shrinks by 1/S",
    "missing-unscale": "optimizer.step() bypassed scaler.step(), so no inf check guards it; it "
                       "matched only because the scale was 1 here",
    "unscale-twice": "unscale_ ran twice for one step",
}


def _explain_with_calls(mismatch: list[Finding], violations: list[Finding],
                        judgement) -> tuple[list[Finding], list[Finding]]:
    """Consequence first: a call-order violation explains a mismatch the judge found (it names
    the offending call); where every update matched it is at most a warning. A clip in scaled
    space at a threshold multiplied by the scale is the same update and says nothing."""
    scaled_sites = {(c.site.file, c.site.line) for s in judgement.steps for c in s.clips
                    if c.scaled_threshold and c.site is not None}
    relevant = [v for v in violations if v.kind not in SCALE_TRAJECTORY_KINDS and not (
        v.kind == "clip-before-unscale" and v.location is not None
        and (v.location.file, v.location.line) in scaled_sites)]
    if mismatch:
        first = mismatch[0]
        same = next((v for v in relevant if v.kind == first.kind), None)
        if same is not None and first.kind != "clip-before-unscale":
            return [same], []
        if first.kind == "gradient-mismatch" and relevant:
            return [relevant[0]], []
        return mismatch, []
    fragile = []
    for v in relevant:
        why = _FRAGILE.get(v.kind, v.message)
        fragile.append(Finding(v.rung, v.kind, "warning",
                               f"Every fp16 update matched the reference, but {why}. "
                               f"({v.message})", evidence=v.evidence, location=v.location))
    return [], fragile


def _skipped(trace: Trace) -> int:
    return sum(1 for e in trace.of_kind("scaler_step") if e.data.get("skipped"))


def _step_ratio(session: Session, trace: Trace, event: Event) -> float | None:
    # A StepRecord carries the sequence number of its "step" event.
    step = next((s for s in trace.steps if s.seq == event.seq), None)
    if step is None:
        return None
    snap = trace.probe.snapshots.get(step.group)
    if snap is None:
        return None
    ordinal = [s.group for s in trace.steps].index(step.group)
    window = session.window_of(step, ordinal, trace)
    names = [n for n in step.grads if n in session.param_shapes]
    ref = session.reference(window, snap.state, snap.training, per_mb=False)
    m = compare.metrics(flat(session, step.grads, names), flat(session, ref.full, names),
                        compare.DEFAULT_TOLERANCES["fp16"])
    return m.ratio if math.isfinite(m.ratio) else None


def runtime_double_scaling(session: Session, trace: Trace, rung: str) -> Finding | None:
    """The loss reaching backward is S x (fp32 loss) x c with c far from 1: a second scale.

    The first backward of both runs happens at identical weights on identical data, so the fp32
    run's value is the unscaled loss the fp16 run should have multiplied by S only.
    """
    fp32 = session.trace("fp32")
    b32 = [e for e in fp32.of_kind("backward") if "value" in e.data]
    b16 = [e for e in trace.of_kind("backward") if "value" in e.data and e.data.get("scaled_by")]
    if not b32 or not b16:
        return None
    v32, v16, scale = b32[0].data["value"], b16[0].data["value"], b16[0].data["scaled_by"]
    if not (v32 and math.isfinite(v32) and math.isfinite(v16) and scale):
        return None
    extra = v16 / (v32 * scale)
    if 0.5 <= abs(extra) <= 2.0:
        return None
    return Finding(
        rung, "double-scaling", "error",
        f"The loss reaching backward is {abs(extra):.6g}x what the scaler alone would give "
        f"(fp32 loss {v32:.6g} x scale {scale:g} = {v32 * scale:.6g}, got {v16:.6g}): a second, "
        f"hand-written loss scale sits on top of the GradScaler. Effective scale "
        f"{abs(extra) * scale:.6g}; {_skipped(trace)} of "
        f"{len(trace.of_kind('scaler_step'))} steps were skipped.",
        evidence={"measured": compare._round(abs(extra) * scale), "expected": scale,
                  "extra_factor": compare._round(abs(extra)), "skipped_steps": _skipped(trace),
                  "scaler_steps": len(trace.of_kind("scaler_step"))},
        location=location(_static_scale_site(b16[0].site) or b16[0].site))


def _static_scale_site(backward: Site | None) -> Site | None:
    """The line that multiplies the loss by a hand-written scale on its way to this backward, as
    the static scan sees it (the backward line itself when the product is inline)."""
    if backward is None:
        return None
    from ..scan import scan_paths

    try:
        report = scan_paths([backward.file])
    except Exception:  # noqa: BLE001 - the runtime finding stands without a better line
        return None
    start = _enclosing_function_start(backward.file, backward.line)
    lines = [o.line for o in report.owners if o.framework == "static" and o.line is not None
             and start <= o.line <= backward.line]
    return Site(backward.file, max(lines), backward.function) if lines else None


def _enclosing_function_start(path: str, line: int) -> int:
    """The first line of the innermost function around `line` (1 when there is none)."""
    import ast

    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return line
    start = 1
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.lineno <= line <= (node.end_lineno or node.lineno) and node.lineno > start:
            start = node.lineno
    return start


def _map_loop_error(trace: Trace, rung: str) -> Finding:
    exc = trace.error
    if isinstance(exc, AssertionError) and "No inf checks were recorded" in str(exc):
        updates = [e for e in trace.of_kind("update") if "error" in e.data]
        site: Site | None = updates[-1].site if updates else trace.error_site
        last_step = max((e.seq for e in trace.of_kind("scaler_step")), default=-1)
        early = [e for e in trace.of_kind("update") if e.seq > last_step]
        return Finding(rung, "update-per-microbatch", "error",
                       "scaler.update() was called again before any unscale_/step of the window: "
                       "torch refused it ('No inf checks were recorded prior to update'). The "
                       "scale must be updated once per optimizer step, not per micro-batch.",
                       evidence={"measured": len(early), "expected": 0,
                                 "updates_before_the_windows_step": len(early),
                                 "error": f"{type(exc).__name__}: {exc}",
                                 "microbatch": trace.events[-1].microbatch if trace.events else None},
                       location=location(site))
    return loop_error_finding(trace, rung)


#: torch's own "this op has no kernel for this dtype on this device" errors: a limit of the
#: backend (oneDNN LSTM in bf16 on CPU, an op without a Half kernel), not of the user's loop.
_BACKEND_LIMITS = re.compile(r"not implemented for '(BFloat16|Half)'|could not create a "
                             r"primitive|onednn|mkldnn|no kernel", re.IGNORECASE)


def _backend_cannot(session: Session, trace: Trace) -> bool:
    exc = trace.error
    if not isinstance(exc, (RuntimeError, NotImplementedError)):
        return False
    fp32 = session.traces.get("fp32")
    if fp32 is None or fp32.error is not None:   # it must run in fp32 to blame the dtype
        return False
    return bool(_BACKEND_LIMITS.search(str(exc)))


def run_precision(session: Session, precision: str, rung: str) -> RungResult:
    trace = session.trace(precision)
    details: dict[str, Any] = {}
    if precision == "fp16":
        details["series"] = _series(trace)
    if trace.error is not None and _backend_cannot(session, trace):
        return RungResult(rung, "skip", f"torch on {session.device.type} cannot run this model in "
                          f"{precision}: {str(trace.error).splitlines()[0][:160]}",
                          details=details)
    if trace.error is not None:
        finding = _map_loop_error(trace, rung)
        return RungResult(rung, "fail", f"the {precision} loop raised ({finding.kind})",
                          [finding], details=details)
    findings = half_open_findings(session, trace, rung)
    if any(f.severity == "error" for f in findings):
        return conclude(rung, findings, "", details)
    if precision == "fp16":
        # An update-per-microbatch or a second loss scale shows in the scale trajectory itself
        # (the consequence this rung judges besides the gradient).
        violations = violation_findings(session, trace, rung)
        trajectory = [v for v in violations if v.kind in SCALE_TRAJECTORY_KINDS]
        double = runtime_double_scaling(session, trace, rung)
        if double is not None:
            trajectory.append(double)
        if trajectory:
            return conclude(rung, findings + trajectory, "", details)
    findings += scheduler_findings(session, trace, rung)
    skipped = _skipped(trace)
    count = step_count_finding(session, trace, rung, skipped_windows=skipped)
    if count is not None:
        return conclude(rung, findings + [count], "", details)
    mismatch, judgement = compare_trace(session, trace, rung, precision)
    comparisons = judgement.steps
    if precision == "fp16":
        mismatch, fragile = _explain_with_calls(mismatch, violations, judgement)
        findings += fragile
    findings += mismatch
    worst = max((c.metrics.rel_err for c in comparisons), default=0.0)
    tol = tolerance(session, precision)
    details.update({"max_relative_error": worst, "tolerance": tol.rtol,
                    "steps_compared": len(comparisons), "skipped_steps": skipped})
    ok = (f"{len(comparisons)} optimizer steps match the reference within {precision} tolerance "
          f"(max relative error {worst:.3g}, tolerance {tol.rtol:g})")
    if worst > tol.rtol:
        ok = (f"{len(comparisons)} optimizer steps match the reference up to {precision} rounding "
              f"(max relative error {worst:.3g} > tolerance {tol.rtol:g}, but same direction and "
              "size: cosine >= 0.95, norm ratio within 0.8-1.25)")
    if skipped:
        ok += f"; {skipped} step(s) skipped by the scaler"
    if not comparisons and skipped and not findings:
        # Nothing was compared: a pass would claim what was never checked.
        return RungResult(rung, "skip", f"every optimizer step ({skipped}) was skipped by the "
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
        return RungResult("bf16-no-scaler", "skip", reason)
    return run_precision(session, "bf16", "bf16-no-scaler")


def run_fp16(session: Session) -> RungResult:
    return run_precision(session, "fp16", "fp16-scaler")
