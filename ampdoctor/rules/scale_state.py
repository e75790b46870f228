"""Rules from the fp16 step state machine and the loss scale (article §16): call-order
violations that explain a mismatch the judge found (or, when every update matched, warn about a
fragile order), and the second loss scale seen in the value reaching backward. The scale
trajectory itself (an update per micro-batch, a second scale) is the consequence these judge."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch

from ..core import thresholds
from ..core.enums import KindId
from ..core.findings import Finding, location
from ..judge import Judgement, judged_live
from ..judge.live import JudgedGroup
from ..kinds.clipping import ScaledClip, scaled_clip
from ..kinds.double_scaling import ScaledTwice, SecondScale, scaled_twice, second_scale
from ..kinds.scaling import (
    SecondUnscale,
    StepOnScaled,
    UpdateWithoutStep,
    second_unscale,
    step_on_scaled,
    update_without_step,
)
from ..maths import compare
from ..probe.callsite import Site
from ..probe.events import Backward, Clip, Event, Scale, ScalerStep, Unscale, Update
from ..probe.statemachine import Illegal, StepStateMachine
from ..session import Session, Trace, flat


def _state_for_window(session: Session, trace: Trace, window: int
                      ) -> tuple[Mapping[str, torch.Tensor], bool] | None:
    for ordinal, step in enumerate(trace.steps):
        if session.window_of(step, ordinal, trace) == window:
            snap = trace.snapshots.get(step.group)
            if snap is not None:
                return snap.state, snap.training
    if window == 0:
        return session.initial_state, True
    return None


def _judged_group(session: Session, trace: Trace, window: int) -> JudgedGroup | None:
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


def _reference_norm(session: Session, trace: Trace, window: int, names: list[str] | None = None
                    ) -> float | None:
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


#: What each observation of the state machine is decided by (its kind's unit).
CallOrder = ScaledClip | StepOnScaled | SecondUnscale | UpdateWithoutStep | ScaledTwice


def call_order_finding(o: CallOrder) -> Finding:
    """The finding of one call-order observation, by its kind's unit."""
    if isinstance(o, ScaledClip):
        return scaled_clip(o)
    if isinstance(o, StepOnScaled):
        return step_on_scaled(o)
    if isinstance(o, SecondUnscale):
        return second_unscale(o)
    if isinstance(o, UpdateWithoutStep):
        return update_without_step(o)
    return scaled_twice(o)


def violation_observations(session: Session, trace: Trace, rung: str) -> list[CallOrder]:
    """What the step state machine saw in `trace`, the first violation of each transition, as
    the numbers its kind's unit words (not yet decided: `explain_with_calls` says whether a
    mismatch makes it an error or every matched update a warning)."""
    machine = StepStateMachine(trace.parameter_owners())
    violations = machine.feed_all(trace.events)
    observed: list[CallOrder] = []
    seen: set[Illegal] = set()
    for v in violations:
        if v.kind in seen:
            continue
        seen.add(v.kind)
        event = v.event
        window = min(trace.window_of_event(event) or 0, session.N - 1)
        scale = _last_scale_before(trace, event.seq)
        site = location(event.site)
        if v.kind is Illegal.CLIP_WHILE_SCALED:
            slot = v.data.get("optimizer")
            unscaled = {e.optimizer for e in trace.events
                        if isinstance(e, Unscale) and e.seq < event.seq
                        and e.optimizer is not None and e.optimizer != slot}
            observed.append(ScaledClip(
                rung, window, scale, v.data.get("total_norm"),
                _reference_norm(session, trace, window), v.data.get("max_norm"),
                by_value=isinstance(event, Clip) and event.clip_kind == "value",
                optimizer=slot, optimizers=len(trace.optimizers),
                unscaled_others=tuple(unscaled), location=site))
        elif v.kind is Illegal.STEP_WHILE_SCALED:
            observed.append(StepOnScaled(rung, window, scale, v.data.get("optimizer"),
                                         step_ratio(session, trace, event), location=site))
        elif v.kind is Illegal.UPDATE_WITHOUT_STEP:
            observed.append(UpdateWithoutStep(rung, window, scale, len(trace.events_of(Update)),
                                              len(trace.events_of(ScalerStep)),
                                              location=site))
        elif v.kind is Illegal.SCALE_OF_SCALED:
            observed.append(ScaledTwice(rung, window, scale, v.data.get("first_scale") or 0,
                                        skipped_steps(trace), location=site))
        else:
            observed.append(SecondUnscale(rung, window, scale, location=site))
    return observed


def violation_findings(session: Session, trace: Trace, rung: str) -> list[Finding]:
    """The state machine's violations in `trace`, each decided as what explains a mismatch
    (an error)."""
    return [call_order_finding(o) for o in violation_observations(session, trace, rung)]


#: State-machine findings whose consequence is the loss-scale trajectory, judged here directly.
SCALE_TRAJECTORY_KINDS = (KindId.UPDATE_PER_MICROBATCH, KindId.DOUBLE_SCALING)


def explain_with_calls(mismatch: list[Finding], violations: list[CallOrder],
                       judgement: Judgement) -> tuple[list[Finding], list[Finding]]:
    """Consequence first: a call-order violation explains a mismatch the judge found (it names
    the offending call); where every update matched it is at most a warning (decided by its
    unit with `update_matched`). A clip in scaled space at a threshold multiplied by the scale
    is the same update and says nothing."""
    scaled_sites = {(c.site.file, c.site.line) for s in judgement.steps for c in s.clips
                    if c.scaled_threshold and c.site is not None}
    relevant = [v for v in violations
                if isinstance(v, (ScaledClip, StepOnScaled, SecondUnscale)) and not (
                    v.kind is KindId.CLIP_BEFORE_UNSCALE and v.location is not None
                    and (v.location.file, v.location.line) in scaled_sites)]
    if mismatch:
        first = mismatch[0]
        same = next((v for v in relevant if v.kind == first.kind), None)
        if same is not None and first.kind != KindId.CLIP_BEFORE_UNSCALE:
            return [call_order_finding(same)], []
        # (a norm read at an infinite threshold changes no update: it explains no mismatch)
        able = [v for v in relevant if not (isinstance(v, ScaledClip) and v.never_clips)]
        if first.kind == KindId.GRADIENT_MISMATCH and able:
            return [call_order_finding(able[0])], []
        return mismatch, []
    return [], [call_order_finding(replace(v, update_matched=True)) for v in relevant]


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
    return second_scale(SecondScale(
        rung, v32, v16, scale, extra, skipped_steps(trace), len(trace.events_of(ScalerStep)),
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
