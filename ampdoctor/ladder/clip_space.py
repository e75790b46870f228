"""Rung `clip-space`: clipping acts on true gradients (article §§6, 9, 14).

Consequence first. One more fp16 pass with run.max_grad_norm forced to a tenth of the true
gradient norm, so clipping really bites: its clipped update must match the reference clipped
the way the loop meant (the parameters it clipped, at the threshold it intended in true space;
`reference.clip_calls`). A clip in scaled space with a threshold multiplied by the scale is the
same update and passes; a clip in scaled space at the plain threshold shrinks the update by
about 1/S and is `clip-before-unscale`. The norm ratio before/after unscale_ of every clip in the
plain fp16 run is reported with it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core import thresholds
from ..core.enums import RungId, Status
from ..core.findings import RungResult, conclude
from ..maths import compare
from ..probe.events import Clip, Scale, Unscale, Update
from ..session import Session, Trace, flat
from .analysis import compare_trace, loop_error_finding

RUNG = RungId.CLIP_SPACE


def _clip_ratios(trace: Trace) -> list[float]:
    """Each clip's norm over the norm after the unscale_ before it (1 in true space, S when
    the clip saw scaled gradients)."""
    ratios = []
    for clip in trace.events_of(Clip):
        unscales = [e for e in trace.events_of(Unscale) if e.seq < clip.seq
                    and e.enabled and not e.inside_step]
        after_update = [e for e in trace.events_of(Update) if e.seq < clip.seq]
        seen = clip.total_norm
        if not unscales or not seen or not math.isfinite(seen):
            continue
        last = unscales[-1]
        if after_update and after_update[-1].seq > last.seq:
            # no unscale_ since the last update: the clip saw S x the true norm
            scale = next((e.scale for e in reversed(trace.events)
                          if isinstance(e, Scale) and e.seq < clip.seq and e.scale), None)
            if scale:
                ratios.append(float(scale))
            continue
        after = last.norm_after
        if after and math.isfinite(after):
            ratios.append(seen / after)
    return ratios


#: Share the pass with skips only when this many windows are left to judge besides the
#: injected one.
MIN_SHARED_WINDOWS = 2


def _shared_with_skips(session: Session, plain: Trace, threshold: float | None
                       ) -> Trace | None:
    """The clipping pass, run once for both rungs: the skips rung's overflow-injected fp16
    run with clipping forced. Its clipped windows are judged as a plain forced run's would be
    (the skipped window consumed nothing). Only when the skips rung will run anyway, windows
    can be told apart by their micro-batches, and the injection did nothing but skip its own
    window -- else None, and clip-space runs its own pass."""
    from . import skips
    chosen = session.spec.rungs
    scaler = skips.scaler_of(plain)
    if ((chosen is not None and skips.RUNG not in chosen) or scaler is None
            or not scaler.is_enabled() or session.N < MIN_SHARED_WINDOWS + 1
            or not (plain.forward_matched or plain.lazy_feed)):
        return None
    shared = skips.injected_run(session, "spec" if threshold is None else threshold,
                                capture=True)
    trace = shared.trace
    applied = skips.applied_windows(session, trace, None)
    expected = skips.applied_windows(session, plain, None) - {shared.window}
    if (trace.error is not None or not shared.injector.fired or applied != expected
            or not all(s.finite for s in trace.steps)):
        trace.release_tensors()   # skips reads its events only
        return None
    return trace


def run(session: Session) -> RungResult:
    trace = session.trace("fp16")
    if trace.error is not None:   # fp16-scaler skipped it: the backend cannot run fp16 here
        return RungResult(RUNG, Status.SKIP,
                          "the fp16 run cannot run on this device (see fp16-scaler)")
    clips = trace.events_of(Clip)
    if not clips:
        reason = ("no max_grad_norm in the spec and the loop never clips" if
                  session.spec.max_grad_norm is None else
                  "the loop never called clip_grad_norm_ / clip_grad_value_ in the fp16 run")
        return RungResult(RUNG, Status.SKIP, reason)
    passed = sorted({e.max_norm for e in clips if e.max_norm})
    details: dict[str, Any] = {"clip_ratios": [compare._round(r) for r in _clip_ratios(trace)],
                               "loop_thresholds": [compare._round(t) for t in passed]}
    ref0 = session.reference(0, per_mb=False)
    true_norm = float(torch.linalg.vector_norm(flat(session, ref0.full, session.param_order)))
    details["true_norm_window0"] = compare._round(true_norm)
    # The loop clips at its own threshold: a plain fp16 pass is the clipped run to judge (the
    # fp16-scaler rung's trace no longer keeps its gradients). Else clipping is forced.
    threshold = (None if session.spec.max_grad_norm is None
                 else thresholds.FORCED_CLIP_FRACTION * true_norm)
    forced = _shared_with_skips(session, trace, threshold)
    if forced is not None:
        details["shared_with_skips"] = (f"the same pass had an overflow injected in window "
                                        f"{session.injected.window}, which is not judged here")
    if threshold is None:
        forced = forced or session.run_loop("fp16", rng_seed=session.spec.seed + 1,
                                            judge_as_it_runs="fp16")
        if forced.error is not None:
            finding = loop_error_finding(forced, RUNG)
            return RungResult(RUNG, Status.FAIL, "the fp16 clipping pass raised", [finding],
                              details=details)
    else:
        details["forced_threshold"] = compare._round(threshold)
        forced = forced or session.run_loop("fp16", max_grad_norm=threshold,
                                            rng_seed=session.spec.seed + 1,
                                            judge_as_it_runs="fp16")
        if forced.error is not None:
            finding = loop_error_finding(forced, RUNG)
            return RungResult(RUNG, Status.FAIL, "the forced-clipping fp16 pass raised", [finding],
                              details=details)
        scales = [e.scale or 1.0 for e in forced.events_of(Scale)] or [1.0]
        meant = [e.max_norm / s for e in forced.events_of(Clip) if e.max_norm
                 for s in (1.0, *scales)]
        if not any(abs(m - threshold) <= thresholds.SCALED_THRESHOLD_RTOL * threshold
                   for m in meant):
            details["forced_clipping"] = (
                "the loop clips at its own threshold, not run.max_grad_norm: its clips were "
                "judged at the thresholds it passes")
    mismatch, judgement = compare_trace(session, forced, RUNG, "fp16", forced_clip=threshold)
    details["steps_compared"] = len(judgement.steps)
    details["max_relative_error"] = judgement.worst_error
    bitten = sum(1 for s in judgement.steps for c in s.clips if c.bit)
    details["clips_that_bit"] = bitten
    findings = list(mismatch)
    if not judgement.steps:
        return RungResult(RUNG, Status.SKIP, "no clipped update to compare: every fp16 step of the "
                          "clipping pass was skipped", details=details)
    shown = ", ".join(f"{r:.4g}" for r in details["clip_ratios"][:3]) or "n/a"
    where = (f"with clipping forced at {threshold:.3g}" if threshold is not None else
             "at the loop's own threshold")
    return conclude(RUNG, findings, f"{len(judgement.steps)} clipped updates {where} match the "
                    f"reference ({bitten} clip(s) bit; norm ratio to unscaled {shown})", details)
