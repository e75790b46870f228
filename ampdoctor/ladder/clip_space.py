"""Rung `clip-space`: clipping acts on true gradients (article §§6, 9, 14).

Two checks on fp16. In the plain fp16 run, the norm `clip_grad_norm_` saw must equal the norm
of the unscaled gradients (ratio ~1, not ~S). Then one more fp16 pass with a threshold a tenth
of the true gradient norm, so clipping really bites: its clipped update must match the
reference clipped at the same threshold in true-gradient space.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import compare
from ..findings import Finding, RungResult, conclude
from ..session import Session, flat
from .analysis import compare_trace, location, loop_error_finding

RUNG = "clip-space"
#: The forced-clipping pass uses this fraction of the reference gradient norm as max_norm.
FORCED_CLIP_FRACTION = 0.1


def _ratio_finding(event, ratio: float, scale: float | None, true_norm: float) -> Finding:
    return Finding(
        RUNG, "clip-before-unscale", "error",
        f"clip_grad_norm_ saw a gradient norm {ratio:.6g}x the true (unscaled) norm "
        f"{true_norm:.6g}; the loss scale is {scale}. Clipping happened in scaled space.",
        evidence={"measured": compare._round(ratio), "expected": 1.0, "scale": scale,
                  "norm_seen_by_clip": event.data.get("total_norm"),
                  "true_norm": compare._round(true_norm)},
        location=location(event.site))


def run(session: Session) -> RungResult:
    if session.spec.max_grad_norm is None:
        return RungResult(RUNG, "skip", "no max_grad_norm in the spec: the loop is not asked to "
                          "clip")
    trace = session.trace("fp16")
    if trace.error is not None:   # fp16-scaler skipped it: the backend cannot run fp16 here
        return RungResult(RUNG, "skip", "the fp16 run cannot run on this device (see fp16-scaler)")
    clips = [e for e in trace.of_kind("clip") if e.data.get("kind") == "norm"]
    if not clips:
        return RungResult(RUNG, "skip", "the loop never called clip_grad_norm_ in the fp16 run")
    findings: list[Finding] = []
    ratios: list[float] = []
    # 1. Each clip against the unscale_ that preceded it in the same step.
    for clip in clips:
        unscales = [e for e in trace.events if e.kind == "unscale" and e.seq < clip.seq
                    and e.data.get("enabled") and not e.data.get("inside_step")]
        since_update = [e for e in trace.events if e.kind == "update" and e.seq < clip.seq]
        if unscales and (not since_update or unscales[-1].seq > since_update[-1].seq):
            after = unscales[-1].data.get("norm_after")
            seen = clip.data.get("total_norm")
            if after and seen and math.isfinite(after) and math.isfinite(seen):
                ratios.append(seen / after)
                if abs(math.log(seen / after)) > math.log(1.5) and not findings:
                    findings.append(_ratio_finding(clip, seen / after,
                                                   unscales[-1].data.get("scale"), after))
    # 2. The forced-clipping pass.
    ref0 = session.reference(0, per_mb=False)
    true_norm = float(torch.linalg.vector_norm(flat(session, ref0.full, session.param_order)))
    threshold = FORCED_CLIP_FRACTION * true_norm
    forced = session.run_loop("fp16", max_grad_norm=threshold, rng_seed=session.spec.seed + 1)
    details: dict[str, Any] = {"forced_threshold": compare._round(threshold),
                               "true_norm_window0": compare._round(true_norm),
                               "clip_ratios": [compare._round(r) for r in ratios]}
    if forced.error is not None:
        finding = loop_error_finding(forced, RUNG)
        return RungResult(RUNG, "fail", "the forced-clipping fp16 pass raised", [finding],
                          details=details)
    forced_clips = [e for e in forced.of_kind("clip") if e.data.get("kind") == "norm"]
    if not forced_clips:
        details["forced_clipping"] = ("the loop did not clip with run.max_grad_norm="
                                      f"{threshold:.4g}: the forced-clipping pass was not checked")
    else:
        mismatch, judgement = compare_trace(session, forced, RUNG, "fp16")
        comparisons = judgement.steps
        for finding in mismatch:
            seen = forced_clips[0].data.get("total_norm")
            unscaled = [e for e in forced.of_kind("unscale") if e.data.get("enabled")]
            scale = unscaled[0].data.get("scale") if unscaled else None
            if seen and true_norm and scale and abs(math.log(seen / true_norm / scale)) < 0.5:
                finding = _ratio_finding(forced_clips[0], seen / true_norm, scale, true_norm)
            else:
                finding.message = (f"With clipping forced (max_grad_norm={threshold:.4g}, a tenth "
                                   "of the true gradient norm) the clipped update differs from "
                                   "the reference clipped at the same threshold: "
                                   + finding.message)
            findings.append(finding)
        details["forced_steps_compared"] = len(comparisons)
        details["forced_max_relative_error"] = max((c.metrics.rel_err for c in comparisons),
                                                   default=0.0)
    shown = ", ".join(f"{r:.4g}" for r in ratios[:3]) or "n/a"
    if not findings and not ratios and not details.get("forced_steps_compared"):
        return RungResult(RUNG, "skip", "no clip could be checked: every clip saw inf/NaN "
                          "gradients or came without an unscale_, and the forced-clipping pass "
                          "applied no update (every fp16 step skipped?)", details=details)
    return conclude(RUNG, findings, f"clip saw the true gradient norm (ratio {shown}); with "
                    f"clipping forced at {threshold:.3g} the update matches the reference",
                    details)
