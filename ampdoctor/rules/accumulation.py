"""The rule that explains a bad step (`classify_step`): it builds the gradient each known
mistake would produce from the same per-micro-batch reference gradients and names the one that
matches, with the numbers and the line. It never decides *that* a step is bad (the judge
does), and it never runs the user's loop (a re-split pass is asked of the rung driver)."""

from __future__ import annotations

import math

import torch

from .. import compare, deciders, thresholds
from ..deciders import Observed
from ..enums import Severity
from ..evidence import Evidence
from ..findings import Finding, location
from ..judge import Judgement, StepJudgement
from ..probe.events import Backward, Clip, Event, Scale, ZeroGrad, of_type
from ..session import Session, Trace, flat
from . import unaveraged
from .frameworks import who_divided
from .shapes import (
    SIZE_FACTOR_KINDS,
    Resplit,
    carried_over,
    clip_in_scaled_space,
    disambiguate,
    summed_count,
    varying_divisor,
)
from .sites import NORM_OR_CLIP, grad_division_between, line_between, second_unscale_site


def unclipped(user: torch.Tensor, events: list[Event]) -> tuple[torch.Tensor, float | None]:
    """Undo a clip that bit on these gradients, from the norm clip_grad_norm_ returned."""
    clips = [e for e in of_type(events, Clip) if e.clip_kind == "norm"]
    if not clips:
        return user, None
    clip = clips[-1]
    total, max_norm = clip.total_norm, clip.max_norm
    if total is None or max_norm is None or not math.isfinite(total):
        return user, total
    coef = max_norm / (total + thresholds.CLIP_EPSILON)
    if coef < 1.0:
        return user / coef, total
    return user, total


def _clip_threshold(events: list[Event]) -> float | None:
    """The threshold of the window's last norm clip (the one `unclipped` undoes)."""
    clips = [e for e in of_type(events, Clip) if e.clip_kind == "norm"]
    return clips[-1].max_norm if clips else None


def clip_would_bite(coefficient: float) -> bool:
    """A clip coefficient that shrinks the gradient enough to tell the clip-before-unscale
    hypothesis from unscale-twice (thresholds.CLIP_BITES_BELOW)."""
    return coefficient < thresholds.CLIP_BITES_BELOW


def direction_holds(cosine: float) -> bool:
    """The mismatch points the reference's way: only its size is off
    (thresholds.SAME_DIRECTION_COSINE)."""
    return cosine > thresholds.SAME_DIRECTION_COSINE


def summed_over_count(cosine: float, ratio: float) -> bool:
    """Right direction and at least thresholds.SUMMED_MIN_RATIO times the reference: worth
    looking for a count of the window the loss is summed over."""
    return direction_holds(cosine) and ratio > thresholds.SUMMED_MIN_RATIO


def wrong_divisor(cosine: float, ratio: float) -> bool:
    """Same direction, a size factor no catalogue shape explains but a divisor could
    (thresholds.EXACT_DIRECTION_COSINE, WRONG_DIVISOR_RATIO_RANGE, RATIO_NEAR_ONE)."""
    low, high = thresholds.WRONG_DIVISOR_RATIO_RANGE
    return (cosine > thresholds.EXACT_DIRECTION_COSINE and low < ratio < high
            and abs(ratio - 1) > thresholds.RATIO_NEAR_ONE)


def classify_step(session: Session, trace: Trace, rung: str, judgement: Judgement,  # noqa: C901 - one branch per known shape of a mismatch, tried in order
                  judged: StepJudgement, rerun: Resplit | None = None) -> Finding:
    """Explain the judge's first bad step. `rerun` is the rung driver's extra fp32 pass
    (`shapes.Resplit`)."""
    K = session.K
    precision, tol = judgement.precision, judgement.tolerance
    ordinal, window, step, m = judged.ordinal, judged.window, judged.step, judged.metrics
    window_events = list(judged.events)
    snapshot = trace.snapshots.get(step.group)
    if snapshot is None:
        # judged as it happened in a group whose weights were gone by then (a second step of
        # the same optimizer without a backward between): the numbers, no explanation
        numbers: Evidence = {"measured": compare._round(m.ratio), "expected": 1.0,
                   "tolerance": tol.rtol, **m.as_evidence(), "step": ordinal,
                   "window": window, "accumulation_steps": K, "precision": precision}
        return deciders.gradient_mismatch(Observed(rung, Severity.ERROR,
                       f"Step {ordinal}: the optimizer consumed a gradient {m.rel_err:.3g} "
                       f"(relative) from the {precision} reference (norm ratio "
                       f"{m.ratio:.4g}, cosine {m.cosine:.4f}).",
                       evidence=numbers, location=location(step.site)))
    names = [n for n in step.grads if n in session.param_shapes]
    user = flat(session, step.grads, names)
    ref = session.reference(window, snapshot.state, snapshot.training, per_mb=True)
    full = flat(session, ref.full, names)
    scaled_clip = next((c for c in judged.clips if c.scale is not None and not c.scaled_threshold),
                       None)
    if scaled_clip is not None:
        return clip_in_scaled_space(session, rung, judged, scaled_clip, ref.full, tol.rtol)
    per_mb = [flat(session, g, names) for g in ref.per_mb or []]
    user_u, clip_norm = unclipped(user, window_events)
    backwards = of_type(window_events, Backward)
    first_backward_seq = backwards[0].seq if backwards else -1
    inside_zero = [e for e in of_type(window_events, ZeroGrad) if e.seq > first_backward_seq
                   and (e.optimizer is None or e.optimizer == step.optimizer
                        or e.owner == "module")]
    contributing_from = None
    if inside_zero:
        last_zero = inside_zero[-1]
        after = sum(1 for e in backwards if e.seq > last_zero.seq)
        contributing_from = K - after
    scale = None
    scale_events = [e for e in of_type(window_events, Scale) if e.scale]
    if scale_events:
        scale = scale_events[-1].scale
    hyps = compare.window_hypotheses(per_mb, ref.counts or [1.0] * len(per_mb), ref.weighted,
                                     full, K, None) if per_mb else []
    hyps += compare.scale_hypotheses(full, scale)
    max_norm = session.spec.max_grad_norm
    if scale and scale != 1.0 and max_norm is not None:
        # A hand-written clip whose norm was taken before unscale_: the threshold met S x the
        # true norm, so the clipped update is 1/S of the reference's clipped update.
        total = float(torch.linalg.vector_norm(
            flat(session, ref.full, session.param_order).double()))
        coef = min(1.0, max_norm / (total + thresholds.CLIP_EPSILON))
        if clip_would_bite(coef):
            hyps.append(compare.Hypothesis(
                "clip-before-unscale",
                f"the reference clipped at max_grad_norm={max_norm:g} and divided by the loss "
                f"scale S={scale:g} (the clip compared the threshold with S x the true norm)",
                full * (coef / scale), coef / scale, {"scale": scale, "clip_coefficient":
                                                      compare._round(coef)}))
    cand_tol = compare.hypothesis_tolerance(tol.rtol)
    found = compare.classify(user_u, full, hyps, cand_tol)
    measured_ratio = float(torch.linalg.vector_norm(user_u.double())) / max(
        float(torch.linalg.vector_norm(full.double())), 1e-30)
    evidence: Evidence = {
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
        return deciders.zero_grad_inside_accumulation(Observed(rung, Severity.ERROR,
                       f"Step {ordinal}: zero_grad ran inside the accumulation window, so only "
                       f"{contributing} of {K} micro-batches reached the optimizer step "
                       f"({'before clipping, ' if clip_norm is not None else ''}gradient norm "
                       f"ratio {measured_ratio:.4g} to the reference, cosine "
                       f"{m.cosine:.4f}).",
                       evidence=evidence, location=location(inside_zero[-1].site)))
    if found is not None and found.kind in SIZE_FACTOR_KINDS:
        rival = SIZE_FACTOR_KINDS[found.kind]
        tied = [h for h in hyps if h.kind == rival and float(torch.linalg.vector_norm(
            user_u.double() - h.vector.double())) <= cand_tol * float(torch.linalg.vector_norm(
                h.vector.double()))]
        if tied:
            # K equal to the micro-batch size makes "no average" and "sum reduction" the same
            # factor: cut the same window differently and see which factor moves.
            decided, resplit = (disambiguate(session, window, snapshot, names, rerun)
                               if rerun is not None else (None, {}))
            if decided is not None:
                evidence["resplit"] = resplit
                if decided != found.kind:
                    hyp = tied[0]
                    found = compare.Classification(hyp.kind, hyp.label, found.rel_err,
                                                   hyp.factor, hyp.extra.copy())
    if found is not None:
        kind = found.kind
        if (kind in ("double-average", "weighted-average-mismatch") and ref.mode == "loop"
                and per_mb):
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
            site = second_unscale_site(window_events) or step.site
        elif kind == "double-average":
            site = grad_division_between(last_backward_site, step.site) or site
        elif kind == "clip-before-unscale":
            site = line_between(last_backward_site, step.site, NORM_OR_CLIP) or step.site
            # as the clip-space rung measures it: how many times the true norm the clip saw
            if m.ratio > 0:
                evidence["measured"] = compare._round(1.0 / m.ratio)
            measured_ratio = m.ratio
        fix = ""
        message = MESSAGES.get(kind, "{label}").format(
            step=ordinal, ratio=measured_ratio, K=K, cos=m.cosine, label=found.label,
            precision=precision, tol=tol.rtol, factor=found.factor or 0)
        if (kind == "missing-accumulation-average" and per_mb
                and unaveraged.weighting_differs(per_mb, full, cand_tol)):
            # the sum of K equal-weight micro-batch means, against a reference that weighs
            # them otherwise: the size says K only against that sum, not against the reference
            equal_sums = unaveraged.summed_equal_weights(user_u, per_mb, full)
            fix = unaveraged.FIX
            evidence.update(unaveraged.evidence(equal_sums))
            message = unaveraged.message(ordinal, K, equal_sums, clip_norm,
                                         _clip_threshold(window_events),
                                         evidence.get("ratio_after_clip"))
        party = who_divided(trace, kind)
        if party is not None:
            evidence["framework"] = party[0]
            message += " " + party[1][0].upper() + party[1][1:]
        return deciders.decide(kind, Observed(rung, Severity.ERROR, message, evidence=evidence,
                                              location=location(site), fix=fix))
    carried = carried_over(session, trace, step, names, user_u, full, cand_tol)
    if carried is not None:
        partial = len(carried) < len(names)
        evidence.update({"measured": len(carried), "expected": 0,
                         "parameters_not_cleared": len(carried), "parameters": len(names),
                         "norm_ratio": compare._round(measured_ratio)})
        zero_grads = of_type(window_events, ZeroGrad) or \
            [e for e in trace.events_of(ZeroGrad) if e.seq < step.seq]
        site = zero_grads[-1].site if partial and zero_grads else step.site
        which = (f"{len(carried)} of {len(names)} parameters ({', '.join(carried[:4])}"
                 + (", ..." if len(carried) > 4 else "") + ")") if partial else "every parameter"
        return deciders.missing_zero_grad(Observed(rung, Severity.ERROR,
                       f"Step {ordinal}: for {which} the optimizer consumed this window's "
                       f"reference gradient plus what step {ordinal - 1} already applied: .grad "
                       "is not cleared after an optimizer step"
                       + (" (the zero_grad call covers only part of the model)" if partial else "")
                       + ", so every step re-applies earlier windows, and an overflow, once in "
                       ".grad, poisons every later window. Clear all gradients after each step, "
                       "skipped or not.",
                       evidence=evidence, location=location(site)))
    # No known shape: say so, with the numbers.
    hint = ""
    if summed_over_count(m.cosine, measured_ratio):
        counted = summed_count(session.window(window), measured_ratio,
                                session.spec.micro_batch_size)
        if counted is not None:
            count, what = counted
            evidence.update({"factor": compare._round(measured_ratio), "count": count})
            return deciders.reduction_mismatch(Observed(rung, Severity.ERROR,
                           f"Step {ordinal}: the gradient is {measured_ratio:.4g}x the reference "
                           f"({what}) with cosine {m.cosine:.5f}: the loss sums over "
                           "samples/elements instead of averaging.",
                           evidence=evidence, location=location(last_backward_site)))
    if direction_holds(m.cosine):
        hint = f" The direction is right (cosine {m.cosine:.5f}); only the size differs."
    varying = varying_divisor(judgement, evidence, ordinal, measured_ratio)
    if varying is not None:
        return deciders.reduction_mismatch(Observed(
                       rung, Severity.ERROR, varying, evidence=evidence,
                       location=location(last_backward_site),
                       fix="Count the tokens (or samples) of the whole optimizer step once, "
                           "over all K micro-batches before the window, and divide every "
                           "micro-batch's summed loss by that one total."))
    if wrong_divisor(m.cosine, measured_ratio):
        # Right direction, wrong size, no catalogue factor: the loss is divided by the wrong
        # number (a hard-coded 8 for K=4, K*K): averaged too much or too little.
        decider = (deciders.double_average if measured_ratio < 1
                   else deciders.missing_accumulation_average)
        evidence["factor"] = compare._round(measured_ratio)
        return decider(Observed(rung, Severity.ERROR,
                       f"Step {ordinal}: the optimizer consumed {measured_ratio:.4g}x the "
                       f"reference gradient with cosine {m.cosine:.5f}: the loss is divided by "
                       f"{K / measured_ratio:.4g} instead of K={K}.",
                       evidence=evidence, location=location(last_backward_site)))
    if rerun is not None and ref.mode == "loss":
        # The reference's per-micro-batch gradients explain nothing: the loop weighs tokens or
        # samples inside a micro-batch its own way. Its own gradient of each micro-batch alone
        # still tells whether the window sums them without dividing by K.
        sums = unaveraged.summed_loop_gradients(session, window, snapshot, names, user_u,
                                                full, rerun, cand_tol)
        if sums is not None:
            evidence.update(unaveraged.evidence(sums))
            return deciders.missing_accumulation_average(Observed(rung, Severity.ERROR,
                           unaveraged.message(ordinal, K, sums, clip_norm,
                                              _clip_threshold(window_events),
                                              evidence.get("ratio_after_clip")),
                           evidence=evidence, location=location(last_backward_site),
                           fix=unaveraged.FIX if sums.weighting_differs else ""))
    return deciders.gradient_mismatch(Observed(rung, Severity.ERROR,
                   f"Step {ordinal} (window {window}) of the {precision} run: the gradient the "
                   f"optimizer consumed differs from the fp32 reference by {m.rel_err:.3g} "
                   f"(relative; tolerance {tol.rtol:g}), norm ratio {measured_ratio:.4g}, cosine "
                   f"{m.cosine:.4f}, matching no known mistake.{hint}",
                   evidence=evidence, location=location(step.site)))


MESSAGES = {
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
