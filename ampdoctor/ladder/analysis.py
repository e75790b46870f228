"""Shared analysis of one trace: loop errors, step and scheduler counts, and the step-by-step
teacher-forced comparison with classification of a mismatch. Used by every comparison rung.
"""

from __future__ import annotations

import linecache
import math
import re
from typing import Any

import torch

from .. import compare
from ..findings import Finding, Location
from ..loading import micro_batch_counts, micro_batch_size_of
from ..probe.callsite import Site
from ..probe.recorder import Event, StepRecord
from ..thresholds import LR_RTOL, VARYING_RATIO_SPREAD
from ..judge import Judgement, StepJudgement, judge, step_groups
from ..session import Session, Trace, flat

#: torch's own error messages that name a known mistake (matched on a stable fragment).
KNOWN_TORCH_ERRORS = (
    ("unscale_() has already been called on this optimizer since the last update()",
     "unscale-twice"),
)


def location(site: Site | None) -> Location | None:
    if site is None:
        return None
    return Location(site.file, site.line, site.function, site.code or None)


def loop_error_finding(trace: Trace, rung: str) -> Finding:
    exc = trace.error
    assert exc is not None
    text = f"{type(exc).__name__}: {exc}"
    if "unscale_()" in str(exc) and update_missing(trace):
        steps = trace.of_kind("scaler_step")
        updates = trace.of_kind("update")
        # Point at the update() that exists but was skipped on this path, else at the step.
        site = (updates[-1].site if updates else steps[-1].site if steps else trace.error_site)
        return Finding(rung, "loop-error", "error",
                       f"In the {trace.precision} run torch refused unscale_(): the previous "
                       "window never reached scaler.update() (a skip path that returns early, "
                       "or no update at all), so the next window's unscale_ counts as a second "
                       "one. Call scaler.update() once per window on every path, skipped or not.",
                       evidence={"error": text, "updates": len(updates),
                                 "scaler_steps": len(steps),
                                 "measured": len(updates), "expected": len(steps) or 1},
                       location=location(site))
    for fragment, kind in KNOWN_TORCH_ERRORS:
        if fragment in str(exc):
            refused = [e for e in trace.of_kind("unscale") if "error" in e.data]
            site = refused[-1].site if refused else trace.error_site
            earlier = [e for e in trace.of_kind("unscale") if "error" not in e.data
                       and not e.data.get("inside_step")
                       and (not refused or e.optimizer == refused[-1].optimizer)]
            first = earlier[-1].site if earlier else None
            also = (f" The first call was at {first.file}:{first.line}; keep one of the two."
                    if first is not None and first != site else "")
            evidence: dict[str, Any] = {"error": text, "measured": 2, "expected": 1,
                                        "unscale_calls_in_step": 2}
            if first is not None:
                evidence["first_unscale"] = f"{first.file}:{first.line}"
            return Finding(rung, kind, "error",
                           f"In the {trace.precision} run torch refused a second unscale_() of "
                           "the same optimizer in one step: the gradients would be divided by "
                           f"the scale twice.{also}",
                           evidence=evidence, location=location(site))
    return Finding(rung, "loop-error", "error",
                   f"The loop raised in the {trace.precision} run: {text}",
                   evidence={"error": text, "precision": trace.precision},
                   location=location(trace.error_site))


def last_unscale_pair(trace: Trace) -> tuple[Event, Event, list[Event]] | None:
    """The last unscale_ of the run (outside scaler.step), the one before it on the same
    optimizer, and the events between them; None when there is no such pair."""
    unscales = [e for e in trace.of_kind("unscale") if not e.data.get("inside_step")]
    if len(unscales) < 2:
        return None
    failing = unscales[-1]
    previous = next((e for e in reversed(unscales[:-1]) if e.optimizer == failing.optimizer),
                    None)
    if previous is None:
        return None
    return previous, failing, [e for e in trace.events if previous.seq < e.seq < failing.seq]


def update_missing(trace: Trace) -> bool:
    """torch refused an unscale_ because the previous window never reached update(): a
    scaler.step with no update after it, or (a hand-written skip path) a previous unscale_ of
    the same optimizer in an earlier window and no update since."""
    last_step = next((e for e in reversed(trace.events) if e.kind == "scaler_step"), None)
    if last_step is not None and not any(e.kind == "update" and e.seq > last_step.seq
                                         for e in trace.events):
        return True
    pair = last_unscale_pair(trace)
    if pair is None:
        return False
    previous, failing, between = pair
    if any(e.kind == "update" for e in between):
        return False
    # The previous unscale_ belongs to an earlier window: that window ended without update()
    # (a skip path that `continue`s). Same window: unscale_ repeated inside it (unscale-twice).
    w_prev, w_fail = trace.window_of_event(previous), trace.window_of_event(failing)
    if w_prev is not None and w_fail is not None:
        return w_prev < w_fail
    # A loop that raised cannot always place events in windows: a full window of backward
    # passes (or a step) between the two calls means a new window began.
    backwards_between = sum(1 for e in between if e.kind == "backward")
    return (backwards_between >= max(trace.accumulation_steps, 2)
            or any(e.kind in ("scaler_step", "step") for e in between))


def scheduler_findings(session: Session, trace: Trace, rung: str) -> list[Finding]:
    """An LR scheduler stepped more than once between two optimizer steps *and* the learning
    rate the optimizer steps used differs from the schedule's value per optimizer step (a
    constant schedule stepped per micro-batch changes nothing and is fine)."""
    scheduler_events = trace.of_kind("scheduler")
    if not scheduler_events:
        return []
    # Window boundaries: every scaler.step (skipped or not) and every direct optimizer.step.
    boundaries = [e.seq for e in trace.events if e.kind == "scaler_step"
                  or (e.kind == "step" and not e.data.get("via_scaler"))]
    per_scheduler: dict[Any, list[Event]] = {}
    for e in scheduler_events:
        # one trajectory per scheduler object: two schedulers on one optimizer (warmup + decay)
        # each stepping once per optimizer step are fine
        per_scheduler.setdefault((e.data.get("scheduler", e.data.get("type")), e.optimizer),
                                 []).append(e)
    optimizer_steps = max(1, len(step_groups(trace)))
    for (_, slot), events in per_scheduler.items():
        counts: dict[int, int] = {}
        for e in events:
            interval = sum(1 for b in boundaries if b < e.seq)
            counts[interval] = counts.get(interval, 0) + 1
        worst = max(counts.values())
        if worst <= 1:
            continue
        drift = _lr_drift(trace, events, slot)
        if drift is None:
            continue
        step, used, meant = drift
        per_step = len(events) / optimizer_steps
        first = events[0]
        return [Finding(
            rung, "scheduler-per-microbatch", "error",
            f"The LR scheduler ({first.data.get('type')}) stepped {len(events)} times for "
            f"{optimizer_steps} optimizer steps in the {trace.precision} run, up to {worst} "
            f"times between two optimizer steps: optimizer step {step} used lr {used:.6g} where "
            f"the schedule gives {meant:.6g} for that step; the schedule runs {per_step:.3g}x "
            "too fast.",
            evidence={"measured": round(per_step, 6), "expected": 1.0,
                      "scheduler_steps": len(events), "optimizer_steps": optimizer_steps,
                      "max_between_optimizer_steps": worst, "lr_used": used,
                      "lr_expected": meant, "first_step_off": step},
            location=location(first.site))]
    return []


def _lr_drift(trace: Trace, events: list[Event], slot: Any) -> tuple[int, float, float] | None:
    """The first optimizer step whose learning rate (from this scheduler's own trajectory)
    differs from the value the schedule gives for that optimizer step; None when every step
    used the right value. Step n used the value after the scheduler's c_n steps so far; it should
    use the value after c_0 + n (a constant offset -- a scheduler stepped before the first
    optimizer step -- is not this mistake)."""
    values = [events[0].data.get("lr_before")] + [e.data.get("lr") for e in events]
    if any(v is None for v in values):
        return None if len({v for v in values if v is not None}) <= 1 else (0, math.nan,
                                                                           math.nan)
    steps = [s for s in trace.steps if slot is None or s.optimizer == slot]
    first_of_group: dict[int, Any] = {}
    for s in steps:
        first_of_group.setdefault(s.group, s)
    used_index = [sum(1 for e in events if e.seq < s.seq) for s in first_of_group.values()]
    if not used_index:
        return None
    offset = used_index[0]
    for n, c in enumerate(used_index):
        meant_index = offset + n
        if c >= len(values) or meant_index >= len(values):
            break
        used, meant = float(values[c]), float(values[meant_index])
        if abs(used - meant) > LR_RTOL * max(abs(meant), 1e-30):
            return n, used, meant
    return None


def step_count_finding(session: Session, trace: Trace, rung: str,
                       skipped_windows: int = 0) -> Finding | None:
    """More optimizer steps than windows: the optimizer steps on every micro-batch."""
    per_optimizer: dict[int, list[StepRecord]] = {}
    for step in trace.steps:
        per_optimizer.setdefault(step.optimizer, []).append(step)
    expected = session.N - skipped_windows
    for slot, steps in sorted(per_optimizer.items()):
        if len(steps) > session.N:
            mb_before_first = steps[0].backwards
            per_window = len(steps) / session.N
            return Finding(
                rung, "step-per-microbatch", "error",
                f"The optimizer stepped {len(steps)} times for {session.N} windows of "
                f"K={session.K} micro-batches in the {trace.precision} run "
                f"({per_window:.3g} steps per window; the first step came after "
                f"{mb_before_first} micro-batch(es)). Each update used a fraction of the window.",
                evidence={"measured": len(steps), "expected": expected,
                          "steps_per_window": round(per_window, 6),
                          "microbatches_before_first_step": mb_before_first,
                          "optimizer": slot},
                location=location(steps[0].site))
    # As many steps as windows, but not on window boundaries: an off-by-one accumulation
    # condition (`i % K == 0` with i from 0 steps after the first micro-batch).
    if not trace.lazy_feed:   # micro-batches fetched up front: cadence cannot be read
        return None
    for slot, steps in sorted(per_optimizer.items()):
        consumed = [s.microbatch + 1 for s in steps]
        off = [(s, n) for s, n in zip(steps, consumed) if n % session.K != 0]
        if off:
            step, n = off[0]
            return Finding(
                rung, "gradient-mismatch", "error",
                f"The optimizer stepped after {n} micro-batch(es), not on a boundary of "
                f"K={session.K}: the accumulation condition is off by one (e.g. "
                "`i % K == 0` with i counted from 0), so the first window holds "
                f"{consumed[0]} micro-batch(es) and every later window straddles two.",
                evidence={"measured": consumed[0], "expected": session.K,
                          "microbatches_at_each_step": consumed, "optimizer": slot},
                location=location(step.site))
    return None


def compare_trace(session: Session, trace: Trace, rung: str,
                  precision: str) -> tuple[list[Finding], Judgement]:
    """Judge every optimizer step (the judge decides); explain the first bad one (the rules)."""
    judgement = judge(session, trace, precision)
    bad = judgement.first_bad
    if bad is None:
        return [], judgement
    return [classify_step(session, trace, rung, judgement, bad)], judgement


def _unclipped(user: torch.Tensor, events: list[Event]) -> tuple[torch.Tensor, float | None]:
    """Undo a clip that bit on these gradients, from the norm clip_grad_norm_ returned."""
    clips = [e for e in events if e.kind == "clip" and e.data.get("kind") == "norm"]
    if not clips:
        return user, None
    clip = clips[-1]
    total, max_norm = clip.data.get("total_norm"), clip.data.get("max_norm")
    if total is None or max_norm is None or not math.isfinite(total):
        return user, total
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        return user / coef, total
    return user, total


def classify_step(session: Session, trace: Trace, rung: str, judgement: Judgement,
                  judged: StepJudgement) -> Finding:
    K = session.K
    precision, tol = judgement.precision, judgement.tolerance
    ordinal, window, step, m = judged.ordinal, judged.window, judged.step, judged.metrics
    window_events = list(judged.events)
    snapshot = trace.probe.snapshots[step.group]
    names = [n for n in step.grads if n in session.param_shapes]
    user = flat(session, step.grads, names)
    ref = session.reference(window, snapshot.state, snapshot.training, per_mb=True)
    full = flat(session, ref.full, names)
    scaled_clip = next((c for c in judged.clips if c.scale is not None and not c.scaled_threshold),
                       None)
    if scaled_clip is not None:
        return _clip_in_scaled_space(session, rung, judged, scaled_clip, ref.full)
    per_mb = [flat(session, g, names) for g in ref.per_mb or []]
    user_u, clip_norm = _unclipped(user, window_events)
    backwards = [e for e in window_events if e.kind == "backward"]
    first_backward_seq = backwards[0].seq if backwards else -1
    inside_zero = [e for e in window_events if e.kind == "zero_grad" and e.seq > first_backward_seq
                   and (e.optimizer is None or e.optimizer == step.optimizer
                        or e.data.get("owner") == "module")]
    contributing_from = None
    if inside_zero:
        last_zero = inside_zero[-1]
        after = sum(1 for e in backwards if e.seq > last_zero.seq)
        contributing_from = K - after
    scale = None
    scale_events = [e for e in window_events if e.kind == "scale" and e.data.get("scale")]
    if scale_events:
        scale = scale_events[-1].data["scale"]
    hyps = compare.window_hypotheses(per_mb, ref.counts or [1.0] * len(per_mb), ref.weighted,
                                     full, K, None) if per_mb else []
    hyps += compare.scale_hypotheses(full, scale)
    max_norm = session.spec.max_grad_norm
    if scale and scale != 1.0 and max_norm is not None:
        # A hand-written clip whose norm was taken before unscale_: the threshold met S x the
        # true norm, so the clipped update is 1/S of the reference's clipped update.
        total = float(torch.linalg.vector_norm(
            flat(session, ref.full, session.param_order).double()))
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 0.999:
            hyps.append(compare.Hypothesis(
                "clip-before-unscale",
                f"the reference clipped at max_grad_norm={max_norm:g} and divided by the loss "
                f"scale S={scale:g} (the clip compared the threshold with S x the true norm)",
                full * (coef / scale), coef / scale, {"scale": scale, "clip_coefficient":
                                                      compare._round(coef)}))
    cand_tol = max(3 * tol.rtol, 2e-3)
    found = compare.classify(user_u, full, hyps, cand_tol)
    measured_ratio = float(torch.linalg.vector_norm(user_u.double())) / max(
        float(torch.linalg.vector_norm(full.double())), 1e-30)
    evidence: dict[str, Any] = {
        "measured": compare._round(measured_ratio), "expected": 1.0,
        "tolerance": tol.rtol, **m.as_evidence(),
        "step": ordinal, "window": window, "accumulation_steps": K,
        "precision": precision,
    }
    if session.spec.micro_batch_size:
        evidence["micro_batch_size"] = session.spec.micro_batch_size
    if clip_norm is not None:
        evidence["clip_total_norm"] = compare._round(clip_norm)
        if user_u is not user:
            # the clip bit: the factor shows before it, not after (both were clipped to max_norm)
            evidence["ratio_after_clip"] = evidence["ratio"]
            evidence["ratio"] = compare._round(measured_ratio)
    last_backward_site = backwards[-1].site if backwards else None

    if inside_zero and (found is None or found.kind in ("zero-grad-inside-accumulation",
                                                         "double-average",
                                                         "weighted-average-mismatch")):
        contributing = K - (contributing_from or 0)
        evidence.update({"measured": contributing, "expected": K,
                         "contributing_microbatches": contributing,
                         "norm_ratio": compare._round(measured_ratio)})
        return Finding(rung, "zero-grad-inside-accumulation", "error",
                       f"Step {ordinal}: zero_grad ran inside the accumulation window, so only "
                       f"{contributing} of {K} micro-batches reached the optimizer step "
                       f"({'before clipping, ' if clip_norm is not None else ''}gradient norm "
                       f"ratio {measured_ratio:.4g} to the reference, cosine "
                       f"{m.cosine:.4f}).",
                       evidence=evidence, location=location(inside_zero[-1].site))
    if found is not None and found.kind in _SIZE_FACTOR_KINDS:
        rival = _SIZE_FACTOR_KINDS[found.kind]
        tied = [h for h in hyps if h.kind == rival and float(torch.linalg.vector_norm(
            user_u.double() - h.vector.double())) <= cand_tol * float(torch.linalg.vector_norm(
                h.vector.double()))]
        if tied:
            # K equal to the micro-batch size makes "no average" and "sum reduction" the same
            # factor: cut the same window differently and see which factor moves.
            decided, resplit = _disambiguate(session, window, snapshot, names, full)
            if decided is not None:
                evidence["resplit"] = resplit
                if decided != found.kind:
                    hyp = tied[0]
                    found = compare.Classification(hyp.kind, hyp.label, found.rel_err,
                                                   hyp.factor, dict(hyp.extra))
    if found is not None:
        kind = found.kind
        if kind in ("double-average", "weighted-average-mismatch") and ref.mode == "loop" and per_mb:
            # Relative to the loop's own K = 1 run a sum reduction divided by K looks like a
            # second average; the full-batch gradient being the *sum* of micro-batch gradients
            # says the loss sums over samples.
            summed = torch.stack(per_mb).sum(0)
            if compare.metrics(full, summed, compare.Tolerance(cand_tol, 0)).ok:
                kind = "reduction-mismatch"
                found = compare.Classification(
                    kind, "the loss sums over samples (the full-batch gradient is the sum of the "
                    "micro-batch gradients) and the loop divides by K only", found.rel_err,
                    found.factor, {})
        evidence["hypothesis"] = found.label
        evidence["hypothesis_error"] = compare._round(found.rel_err)
        if found.factor is not None:
            evidence["factor"] = compare._round(found.factor)
        evidence.update(found.extra)
        site = last_backward_site
        if kind == "missing-unscale":
            site = step.site
        elif kind == "unscale-twice":
            site = _second_unscale_site(window_events) or step.site
        elif kind == "double-average":
            site = _grad_division_between(last_backward_site, step.site) or site
        elif kind == "clip-before-unscale":
            site = _line_between(last_backward_site, step.site, _NORM_OR_CLIP) or step.site
            # as the clip-space rung measures it: how many times the true norm the clip saw
            if m.ratio > 0:
                evidence["measured"] = compare._round(1.0 / m.ratio)
            measured_ratio = m.ratio
        message = _MESSAGES.get(kind, "{label}").format(
            step=ordinal, ratio=measured_ratio, K=K, cos=m.cosine, label=found.label,
            precision=precision, tol=tol.rtol, factor=found.factor or 0)
        return Finding(rung, kind, "error", message, evidence=evidence, location=location(site))
    carried = _carried_over(session, trace, step, names, user_u, full, cand_tol)
    if carried is not None:
        partial = len(carried) < len(names)
        evidence.update({"measured": len(carried), "expected": 0,
                         "parameters_not_cleared": len(carried), "parameters": len(names),
                         "norm_ratio": compare._round(measured_ratio)})
        zero_grads = [e for e in window_events if e.kind == "zero_grad"] or \
            [e for e in trace.of_kind("zero_grad") if e.seq < step.seq]
        site = zero_grads[-1].site if partial and zero_grads else step.site
        which = (f"{len(carried)} of {len(names)} parameters ({', '.join(carried[:4])}"
                 + (", ..." if len(carried) > 4 else "") + ")") if partial else "every parameter"
        return Finding(rung, "missing-zero-grad", "error",
                       f"Step {ordinal}: for {which} the optimizer consumed this window's "
                       f"reference gradient plus what step {ordinal - 1} already applied: .grad "
                       "is not cleared after an optimizer step"
                       + (" (the zero_grad call covers only part of the model)" if partial else "")
                       + ", so every step re-applies earlier windows, and an overflow, once in "
                       ".grad, poisons every later window. Clear all gradients after each step, "
                       "skipped or not.",
                       evidence=evidence, location=location(site))
    # No known shape: say so, with the numbers.
    hint = ""
    if m.cosine > 0.999 and measured_ratio > 1.5:
        counted = _summed_count(session.window(window), measured_ratio,
                                session.spec.micro_batch_size)
        if counted is not None:
            count, what = counted
            evidence.update({"factor": compare._round(measured_ratio), "count": count})
            return Finding(rung, "reduction-mismatch", "error",
                           f"Step {ordinal}: the gradient is {measured_ratio:.4g}x the reference "
                           f"({what}) with cosine {m.cosine:.5f}: the loss sums over "
                           "samples/elements instead of averaging.",
                           evidence=evidence, location=location(last_backward_site))
    if m.cosine > 0.999:
        hint = f" The direction is right (cosine {m.cosine:.5f}); only the size differs."
    varying = _varying_divisor(judgement, evidence, ordinal, measured_ratio)
    if varying is not None:
        return Finding(rung, "reduction-mismatch", "error", varying, evidence=evidence,
                       location=location(last_backward_site),
                       fix="Count the tokens (or samples) of the whole optimizer step once, "
                           "over all K micro-batches before the window, and divide every "
                           "micro-batch's summed loss by that one total.")
    if m.cosine > 0.9999 and 0.05 < measured_ratio < 20 and abs(measured_ratio - 1) > 0.05:
        # Right direction, wrong size, no catalogue factor: the loss is divided by the wrong
        # number (a hard-coded 8 for K=4, K*K): averaged too much or too little.
        kind = "double-average" if measured_ratio < 1 else "missing-accumulation-average"
        evidence["factor"] = compare._round(measured_ratio)
        return Finding(rung, kind, "error",
                       f"Step {ordinal}: the optimizer consumed {measured_ratio:.4g}x the "
                       f"reference gradient with cosine {m.cosine:.5f}: the loss is divided by "
                       f"{K / measured_ratio:.4g} instead of K={K}.",
                       evidence=evidence, location=location(last_backward_site))
    return Finding(rung, "gradient-mismatch", "error",
                   f"Step {ordinal} (window {window}) of the {precision} run: the gradient the "
                   f"optimizer consumed differs from the fp32 reference by {m.rel_err:.3g} "
                   f"(relative; tolerance {tol.rtol:g}), norm ratio {measured_ratio:.4g}, cosine "
                   f"{m.cosine:.4f}, matching no known mistake.{hint}",
                   evidence=evidence, location=location(step.site))


def _clip_in_scaled_space(session: Session, rung: str, judged: StepJudgement, call,
                          reference: dict[str, torch.Tensor | None]) -> Finding:
    """The update differs and a clip ran on gradients still multiplied by the loss scale, at a
    threshold the loop means in true space: the threshold met S x the true norm."""
    from ..reference import reference_norm
    every = session.param_order
    sizes = {n: math.prod(session.param_shapes[n]) for n in every}
    true_norm = reference_norm(flat(session, reference, every), every, sizes, call)
    seen = call.total_norm
    m = judged.metrics
    evidence: dict[str, Any] = {
        "measured": compare._round(seen / true_norm) if seen and true_norm else None,
        "expected": 1.0, "scale": call.scale, "norm_seen_by_clip": seen,
        "true_norm": compare._round(true_norm), "max_grad_norm": call.threshold,
        "step": judged.ordinal, "window": judged.window, **m.as_evidence(),
        "tolerance": m.allowed and compare._round(m.allowed / max(m.norm_ref, 1e-30))}
    if call.kind == "value":
        evidence["measured"] = call.scale
        message = (f"Step {judged.ordinal}: clip_grad_value_ ran before scaler.unscale_: the clip "
                   f"value {call.threshold:g} was applied to gradients multiplied by the loss "
                   f"scale {call.scale:g}, i.e. a clip value {call.scale:g}x too small in "
                   f"true-gradient space; the update is {m.ratio:.4g}x the reference.")
    else:
        message = (f"Step {judged.ordinal}: clip_grad_norm_ ran before scaler.unscale_: it saw a "
                   f"gradient norm of {seen:.6g} where the true norm is {true_norm:.6g} (the "
                   f"loss scale {call.scale:g}), so the threshold {call.threshold:g} was applied "
                   f"in scaled space and the update is {m.ratio:.4g}x the reference clipped at "
                   f"{call.threshold:g}.")
    return Finding(rung, "clip-before-unscale", "error", message, evidence=evidence,
                   location=location(call.site))


def _varying_divisor(judgement: Judgement, evidence: dict[str, Any], ordinal: int,
                     ratio: float) -> str | None:
    """Right direction at every step, but a size that changes from step to step: the loss is
    normalised by a count that varies (a token count overwritten per micro-batch), not by a
    constant such as K -- so "divide by K" would not fix it."""
    same_direction = [s for s in judgement.steps if s.metrics.cosine > 0.9999]
    if len(same_direction) < 2 or len(same_direction) < len(judgement.steps):
        return None
    ratios = [s.preclip_ratio if s.preclip_ratio is not None else s.metrics.ratio
              for s in same_direction]
    low, high = min(ratios), max(ratios)
    if low <= 0 or high / low - 1 <= VARYING_RATIO_SPREAD or all(abs(r - 1) < 0.05
                                                                  for r in ratios):
        return None
    evidence["ratios_per_step"] = [compare._round(r) for r in ratios]
    evidence["ratio_spread"] = compare._round(high / low - 1)
    return (f"Step {ordinal}: the optimizer consumed {ratio:.4g}x the reference gradient with "
            "the right direction, and the factor changes from step to step ("
            + ", ".join(f"{r:.4g}" for r in ratios) + "): the loss is normalised by a count "
            "that varies per step (e.g. the token count of one micro-batch, overwritten in a "
            "loop) instead of the whole step's total. Divide the summed loss by the number of "
            "tokens/samples in the whole optimizer step.")


def _carried_over(session: Session, trace: Trace, step: StepRecord, names: list[str],
                  user: torch.Tensor, full: torch.Tensor, tol: float) -> list[str] | None:
    """The parameters whose consumed gradient is this window's reference plus what the same
    optimizer's previous step consumed (.grad not cleared between the two steps), when every
    parameter is either that or the reference alone; None otherwise."""
    previous = [s for s in trace.steps if s.group < step.group and s.optimizer == step.optimizer]
    if not previous:
        return None
    prev = flat(session, previous[-1].grads, names).double()
    u, ref = user.double(), full.double()
    carried, offset = [], 0
    for name in names:
        n = math.prod(session.param_shapes[name])
        sl = slice(offset, offset + n)
        offset += n
        fresh_err = _rel(u[sl], ref[sl])
        kept_err = _rel(u[sl], ref[sl] + prev[sl])
        if kept_err <= tol and kept_err < fresh_err:
            carried.append(name)
        elif fresh_err > tol:
            return None
    return carried or None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(torch.linalg.vector_norm(b))
    diff = float(torch.linalg.vector_norm(a - b))
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)


def _summed_count(micro_batches: list[Any], ratio: float,
                  micro_batch_size: int | None) -> tuple[int, str] | None:
    """A gradient `ratio` times the reference that equals a count every micro-batch of the
    window shares -- its samples, the elements of one of its tensors (tokens of a [b, T]
    label tensor), its non-ignored labels (!= -100) -- is a loss summed over that count."""
    if not micro_batches:
        return None
    per_mb = [micro_batch_counts(mb) for mb in micro_batches]
    shared = {what: n for what, n in per_mb[0].items()
              if n > 1 and all(c.get(what) == n for c in per_mb)}
    for what, n in shared.items():
        if what != "samples" and abs(ratio / n - 1) <= 0.01:
            return int(n), f"the {int(n)} {what} per micro-batch"
    b = micro_batch_size or shared.get("samples")
    if b:
        multiple = compare.nearest_integer_factor(ratio, b)
        if multiple is not None:
            return multiple * int(b), (f"{multiple} x micro_batch_size {int(b)}" if multiple > 1
                                       else f"micro_batch_size {int(b)}")
    return None


_SIZE_FACTOR_KINDS = {"missing-accumulation-average": "reduction-mismatch",
                      "reduction-mismatch": "missing-accumulation-average"}


def _disambiguate(session: Session, window: int, snapshot, names: list[str],
                  full: torch.Tensor) -> tuple[str | None, dict[str, Any]]:
    """Re-run the first K' = K // 2 micro-batches of the window as one step (same micro-batches,
    so batch statistics do not change) and see whether the gradient's factor follows K' (no
    average) or stays at the micro-batch size (sum reduction)."""
    K2 = max(1, session.K // 2)
    part = session.window(window)[:K2]
    b = micro_batch_size_of(part[0])
    if K2 == b:
        return None, {}
    no_clip = math.inf if session.spec.max_grad_norm is not None else None
    trace = session.run_loop("fp32", micro_batches=part, K=K2, state=snapshot.state,
                             training=snapshot.training, max_grad_norm=no_clip)
    if trace.error is not None or not trace.steps:
        return None, {}
    grads: dict[str, torch.Tensor | None] = {}
    for step in trace.steps:
        if step.group == trace.steps[0].group:
            grads.update(step.grads)
    ref = session.reference_for(part, snapshot.state, snapshot.training, per_mb=False,
                                label=f"the first {K2} micro-batches of window {window}")
    ratio = float(torch.linalg.vector_norm(flat(session, grads, names))) / max(
        float(torch.linalg.vector_norm(flat(session, ref.full, names))), 1e-30)
    info = {"accumulation_steps": K2, "micro_batch_size": b, "ratio": compare._round(ratio)}
    if abs(ratio / K2 - 1) < 0.02:
        return "missing-accumulation-average", info
    if abs(ratio / b - 1) < 0.02:
        return "reduction-mismatch", info
    return None, info


def _grad_division_between(first: Site | None, last: Site | None) -> Site | None:
    """A hand-written `p.grad.div_(K)` / `p.grad /= K` between the backward and the step."""
    return _line_between(first, last, _GRAD_DIVISION)


def _line_between(first: Site | None, last: Site | None, pattern: re.Pattern) -> Site | None:
    """The first line strictly between two call sites of one file whose code matches."""
    if first is None or last is None or first.file != last.file or last.line <= first.line:
        return None
    for line in range(first.line + 1, last.line):
        code = linecache.getline(first.file, line).split("#", 1)[0]
        if pattern.search(code):
            return Site(first.file, line, first.function)
    return None


#: A line that measures or clips gradient norms (a hand-written clip).
_NORM_OR_CLIP = re.compile(r"norm|clip", re.I)


def _second_unscale_site(events: list[Event]) -> Site | None:
    """Where gradients were divided by the scale a second time: a `get_scale()` read after
    unscale_ (a hand-written division), else the unscale_ call itself."""
    unscales = [e for e in events if e.kind == "unscale" and e.data.get("enabled")]
    if not unscales:
        return None
    after = [e for e in events if e.kind == "get_scale" and e.seq > unscales[0].seq]
    if not after:
        return unscales[-1].site
    site = after[0].site
    # The read of the scale is often a line above the division itself (inv = 1 / get_scale();
    # p.grad.mul_(inv)): point at the division when it follows within a few lines.
    if site is not None:
        for line in range(site.line, site.line + 12):
            code = linecache.getline(site.file, line).split("#", 1)[0]
            if _GRAD_DIVISION.search(code):
                return Site(site.file, line, site.function)
    return site


_GRAD_DIVISION = re.compile(r"\.grad\b.*(\b(div_|mul_|mul|div)\(|/=|\*=)|"
                            r"\b(div_|mul_)\(.*scale")


_MESSAGES = {
    "missing-accumulation-average":
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient (cosine "
        "{cos:.5f}) = the sum of the K={K} micro-batch gradients: the loss is not divided by "
        "accumulation_steps.",
    "double-average":
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient (cosine "
        "{cos:.5f}), 1/K with K={K}: the gradient is averaged twice.",
    "reduction-mismatch":
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient (cosine "
        "{cos:.5f}): {label}. The loss reduction and the averaging factor disagree.",
    "weighted-average-mismatch":
        "Step {step}: the optimizer consumed the {label} (norm ratio {ratio:.4g}, cosine "
        "{cos:.5f} to the weighted reference): micro-batches with few tokens count as much as "
        "full ones.",
    "zero-grad-inside-accumulation":
        "Step {step}: the optimizer consumed {label} (norm ratio {ratio:.4g}, cosine {cos:.5f}): "
        "gradients were cleared inside the window.",
    "missing-unscale":
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient = {label}: it "
        "stepped on scaled gradients.",
    "unscale-twice":
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient = {label}: the "
        "gradients were divided by the scale twice.",
    "clip-before-unscale":
        "Step {step}: the optimizer consumed {ratio:.4g}x the reference gradient = {label}: the "
        "gradients were clipped against a norm taken before unscale_, in scaled space.",
}
