"""Rules from the fp16 step state machine and the loss scale (article §16): call-order
violations that explain a mismatch the judge found (or, when every update matched, warn about a
fragile order), and the second loss scale seen in the value reaching backward. The scale
trajectory itself (an update per micro-batch, a second scale) is the consequence these judge."""

from __future__ import annotations

import math

import torch

from .. import compare, deciders, thresholds
from ..deciders import Observed
from ..enums import Severity
from ..evidence import Evidence
from ..findings import Finding, location
from ..judge import judged_live
from ..probe.callsite import Site
from ..probe.events import Backward, Clip, Event, Scale, ScalerStep, Unscale, Update
from ..probe.statemachine import StepStateMachine
from ..session import Session, Trace, flat


def _state_for_window(session: Session, trace: Trace, window: int):
    for ordinal, step in enumerate(trace.steps):
        if session.window_of(step, ordinal, trace) == window:
            snap = trace.snapshots.get(step.group)
            if snap is not None:
                return snap.state, snap.training
    if window == 0:
        return session.initial_state, True
    return None


def _judged_group(session: Session, trace: Trace, window: int):
    """The step group of `window` judged as it happened whose weights were not kept, if any."""
    judge = judged_live(trace)
    if judge is None:
        return None
    for ordinal, step in enumerate(trace.steps):
        if session.window_of(step, ordinal, trace) == window:
            done = judge.groups.get(step.group)
            if done is not None and not done.stop and step.group not in trace.snapshots:
                return done
            return None
    return None


def _reference_norm(session: Session, trace: Trace, window: int, names: list[str] | None = None):
    done = _judged_group(session, trace, window)
    if done is not None:   # the judge kept each parameter's squared norm, not the weights
        return done.reference_norm(names or session.param_order)
    found = _state_for_window(session, trace, window)
    if found is None:
        return None
    ref = session.reference(window, found[0], found[1], per_mb=False)
    return float(torch.linalg.vector_norm(flat(session, ref.full, names or session.param_order)))


def _last_scale_before(trace: Trace, seq: int) -> float | None:
    scales = [e.scale for e in trace.events_of(Scale) if e.seq < seq
              and e.scale]
    return scales[-1] if scales else None


def violation_findings(session: Session, trace: Trace, rung: str) -> list[Finding]:
    machine = StepStateMachine(trace.parameter_owners())
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
        evidence: Evidence = {"scale": scale, "window": window}
        if v.kind == "clip-before-unscale":
            seen_norm = v.data.get("total_norm")
            true_norm = _reference_norm(session, trace, window)
            ratio = (seen_norm / true_norm) if seen_norm and true_norm else None
            by_value = isinstance(event, Clip) and event.clip_kind == "value"
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
            if len(trace.optimizers) > 1 and slot is not None:
                evidence["optimizer"] = slot
                unscaled = sorted({e.optimizer for e in trace.events
                                   if isinstance(e, Unscale) and e.seq < event.seq
                                   and e.optimizer is not None and e.optimizer != slot})
                message += (f" Optimizer {slot} (of {len(trace.optimizers)}) had not been "
                            "unscaled" + (f" although optimizer(s) {unscaled} had: the clip "
                                          "mixed scaled and true gradients" if unscaled else "")
                            + f"; call scaler.unscale_() on optimizer {slot} before clipping.")
        elif v.kind == "missing-unscale":
            slot = v.data.get("optimizer")
            ratio = step_ratio(session, trace, event)
            evidence.update({"measured": compare._round(ratio) if ratio else None,
                             "expected": 1.0, "optimizer": slot})
            message = (f"Optimizer {slot} stepped with its own .step() on gradients still "
                       f"multiplied by the loss scale {scale:g}"
                       + (f": its gradient is {ratio:.6g}x the reference." if ratio else ".")
                       + " scaler.step() was bypassed, so it was never unscaled nor checked for "
                         "inf.")
        elif v.kind == "update-per-microbatch":
            updates = len(trace.events_of(Update))
            steps = len(trace.events_of(ScalerStep))
            evidence.update({"measured": updates, "expected": steps,
                             "updates": updates, "scaler_steps": steps})
            message = (f"scaler.update() ran {updates} times for {steps} scaler.step() calls: "
                       "more than once per optimizer step.")
        elif v.kind == "double-scaling":
            first = v.data.get("first_scale") or 0
            evidence.update({"measured": compare._round(first * (scale or 1)),
                             "expected": scale, "skipped_steps": skipped_steps(trace)})
            message = (f"scaler.scale() was applied to a loss that was already scaled by "
                       f"{first:g}: the effective loss scale is {first * (scale or 1):.6g}, not "
                       f"{scale:g}.")
        else:
            evidence.update({"measured": 2, "expected": 1})
            message = v.detail
        findings.append(deciders.decide(v.kind, Observed(
            rung, Severity.ERROR, message, evidence=evidence, location=location(event.site))))
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


def explain_with_calls(mismatch: list[Finding], violations: list[Finding],
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
        fragile.append(deciders.decide(v.kind, Observed(v.rung, Severity.WARNING,
                               f"Every fp16 update matched the reference, but {why}. "
                               f"({v.message})", evidence=v.evidence, location=v.location)))
    return [], fragile


def skipped_steps(trace: Trace) -> int:
    return sum(1 for e in trace.events_of(ScalerStep) if e.skipped)


def step_ratio(session: Session, trace: Trace, event: Event) -> float | None:
    # A StepRecord carries the sequence number of its "step" event.
    step = next((s for s in trace.steps if s.seq == event.seq), None)
    if step is None:
        return None
    snap = trace.snapshots.get(step.group)
    names = [n for n in step.grads if n in session.param_shapes]
    judge = judged_live(trace)
    done = judge.groups.get(step.group) if judge is not None and snap is None else None
    if done is not None and step.seq in done.grad_squares:
        # judged as it happened: each parameter's squared norm was kept, not the tensors
        user, ref = done.gradient_norm(step.seq, names), done.reference_norm(names)
        ratio = user / ref if ref > 0 else (1.0 if user == 0 else math.inf)
        return ratio if math.isfinite(ratio) else None
    if snap is None:
        return None
    ordinal = [s.group for s in trace.steps].index(step.group)
    window = session.window_of(step, ordinal, trace)
    reference = session.reference(window, snap.state, snap.training, per_mb=False)
    m = compare.metrics(flat(session, step.grads, names), flat(session, reference.full, names),
                        compare.DEFAULT_TOLERANCES["fp16"])
    return m.ratio if math.isfinite(m.ratio) else None


def runtime_double_scaling(fp32: Trace, trace: Trace, rung: str) -> Finding | None:
    """The loss reaching backward is S x (fp32 loss) x c with c far from 1: a second scale.

    The first backward of both runs (the fp32 run `fp32` and this one) happens at identical
    weights on identical data, so the fp32 run's value is the unscaled loss the fp16 run should
    have multiplied by S only.
    """
    b32 = [e for e in fp32.events_of(Backward) if e.value is not None]
    b16 = [e for e in trace.events_of(Backward) if e.value is not None and e.scaled_by]
    if not b32 or not b16:
        return None
    v32, v16, scale = b32[0].value, b16[0].value, b16[0].scaled_by
    assert v32 is not None and v16 is not None   # (only backwards whose loss was read)
    if not (v32 and math.isfinite(v32) and math.isfinite(v16) and scale):
        return None
    extra = v16 / (v32 * scale)
    low, high = thresholds.SECOND_SCALE_BAND
    if low <= abs(extra) <= high:
        return None
    return deciders.double_scaling(Observed(rung, Severity.ERROR,
        f"The loss reaching backward is {abs(extra):.6g}x what the scaler alone would give "
        f"(fp32 loss {v32:.6g} x scale {scale:g} = {v32 * scale:.6g}, got {v16:.6g}): a second, "
        f"hand-written loss scale sits on top of the GradScaler. Effective scale "
        f"{abs(extra) * scale:.6g}; {skipped_steps(trace)} of "
        f"{len(trace.events_of(ScalerStep))} steps were skipped.",
        evidence={"measured": compare._round(abs(extra) * scale), "expected": scale,
                  "extra_factor": compare._round(abs(extra)), "skipped_steps": skipped_steps(trace),
                  "scaler_steps": len(trace.events_of(ScalerStep))},
        location=location(_static_scale_site(b16[0].site) or b16[0].site)))


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
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return line
    start = 1
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.lineno <= line <= (node.end_lineno or node.lineno) and node.lineno > start:
            start = node.lineno
    return start
