"""The judge's first bad step laid out for the shape-tryers of `accumulation.classify_step`
(`StepCase`): the consumed gradient with a clip that bit undone, the window's reference, the
hypotheses built from it and the one that matched, and the numbers so far."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core import thresholds
from ..core.enums import KindId
from ..core.evidence import Evidence
from ..judge import Judgement, StepJudgement
from ..maths import compare
from ..probe.events import Backward, Clip, Event, Scale, Snapshot, ZeroGrad, of_type
from ..reference.gradients import WindowReference
from ..session import Session, Trace, flat
from .frameworks import framework_of
from .shapes import Resplit


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


def clip_threshold(events: list[Event]) -> float | None:
    """The threshold of the window's last norm clip (the one `unclipped` undoes)."""
    clips = [e for e in of_type(events, Clip) if e.clip_kind == "norm"]
    return clips[-1].max_norm if clips else None


def clip_would_bite(coefficient: float) -> bool:
    """A clip coefficient that shrinks the gradient enough to tell the clip-before-unscale
    hypothesis from unscale-twice (thresholds.CLIP_BITES_BELOW)."""
    return coefficient < thresholds.CLIP_BITES_BELOW


@dataclass
class StepCase:
    """The judge's first bad step laid out for the shape-tryers: the consumed gradient (a clip
    that bit undone), the window's reference, the hypotheses and the one that matched, and the
    numbers so far (`evidence`, which a tryer completes before it returns its finding)."""

    session: Session
    trace: Trace
    rung: str
    judgement: Judgement
    judged: StepJudgement
    rerun: Resplit | None
    snapshot: Snapshot
    names: list[str]
    ref: WindowReference
    full: torch.Tensor
    per_mb: list[torch.Tensor]
    user: torch.Tensor
    user_u: torch.Tensor
    clip_norm: float | None
    backwards: list[Backward]
    inside_zero: list[ZeroGrad]
    contributing_from: int | None
    hyps: list[compare.Hypothesis]
    cand_tol: float
    found: compare.Classification | None
    measured_ratio: float
    evidence: Evidence
    #: the threshold the clip-space rung forced (rung context its findings say), else None
    forced_clip: float | None = None

    @property
    def K(self) -> int:
        return self.session.K

    @property
    def m(self) -> compare.Metrics:
        return self.judged.metrics

    @property
    def window_events(self) -> list[Event]:
        return list(self.judged.events)

    @property
    def last_backward_site(self) -> Any:
        return self.backwards[-1].site if self.backwards else None


def build_case(session: Session, trace: Trace, rung: str, judgement: Judgement,
          judged: StepJudgement, rerun: Resplit | None, snapshot: Snapshot, names: list[str],
          ref: WindowReference, forced_clip: float | None = None) -> StepCase:
    """The step's gradients, the hypotheses built from the reference, the best match."""
    K, tol, step = session.K, judgement.tolerance, judged.step
    window_events = list(judged.events)
    user = flat(session, step.grads, names)
    full = flat(session, ref.full, names)
    per_mb = [flat(session, g, names) for g in ref.per_mb or []]
    user_u, clip_norm = unclipped(user, window_events)
    backwards = _own_backwards(trace, of_type(window_events, Backward), step.optimizer)
    first_backward_seq = backwards[0].seq if backwards else -1
    inside_zero = [e for e in of_type(window_events, ZeroGrad) if e.seq > first_backward_seq
                   and (e.optimizer is None or e.optimizer == step.optimizer
                        or e.owner == "module")]
    contributing_from = None
    if inside_zero:
        contributing_from = K - sum(1 for e in backwards if e.seq > inside_zero[-1].seq)
    hyps = compare.window_hypotheses(per_mb, ref.counts or [1.0] * len(per_mb), ref.weighted,
                                     full, K, None) if per_mb else []
    hyps += _scale_hypotheses(session, ref, full, window_events)
    cand_tol = compare.hypothesis_tolerance(tol.rtol)
    found = compare.classify(user_u, full, hyps, cand_tol)
    measured_ratio = float(torch.linalg.vector_norm(user_u.double())) / max(
        float(torch.linalg.vector_norm(full.double())), 1e-30)
    evidence: Evidence = {
        "measured": compare._round(measured_ratio), "expected": 1.0,
        "tolerance": tol.rtol, **judged.metrics.as_evidence(),
        "step": judged.ordinal, "window": judged.window, "accumulation_steps": K,
        "precision": judgement.precision,
    }
    if session.spec.micro_batch_size:
        evidence["micro_batch_size"] = session.spec.micro_batch_size
    framework = framework_of(trace)
    if framework is not None:   # the fix is then said in that framework's terms
        evidence["framework"] = framework
    if getattr(trace, "backward_optimizers", None) is not None and trace.optimizer_count > 1:
        evidence["optimizer"] = step.optimizer   # which of the script's optimizers stepped
    if clip_norm is not None:
        evidence["clip_total_norm"] = compare._round(clip_norm)
        if user_u is not user:
            # the clip bit: the factor shows before it, not after (both were clipped to max_norm)
            evidence["ratio_after_clip"] = evidence["ratio"]
            evidence["ratio"] = compare._round(measured_ratio)
    return StepCase(session, trace, rung, judgement, judged, rerun, snapshot, names, ref, full,
                 per_mb, user, user_u, clip_norm, backwards, inside_zero, contributing_from,
                 hyps, cand_tol, found, measured_ratio, evidence, forced_clip)


def _own_backwards(trace: Trace, backwards: list[Backward], optimizer: int) -> list[Backward]:
    """The window's backwards that gave gradients to the stepping optimizer's parameters, where
    the trace knows it (a script's run: a GAN's two losses train two models), else all."""
    touched = getattr(trace, "backward_optimizers", None)
    if touched is None:
        return backwards
    own = [e for e in backwards if optimizer in (touched(e) or {optimizer})]
    return own or backwards


def _scale_hypotheses(session: Session, ref: WindowReference, full: torch.Tensor,
                      window_events: list[Event]) -> list[compare.Hypothesis]:
    """The loss-scale shapes: S or 1/S (`compare.scale_hypotheses`), and a hand-written clip
    whose norm was taken before unscale_."""
    scale_events = [e for e in of_type(window_events, Scale) if e.scale]
    scale = scale_events[-1].scale if scale_events else None
    hyps = compare.scale_hypotheses(full, scale)
    max_norm = session.spec.max_grad_norm
    if scale and scale != 1.0 and max_norm is not None:
        # A hand-written clip whose norm was taken before unscale_: the threshold met S x the
        # true norm, so the clipped update is 1/S of the reference's clipped update.
        total = float(torch.linalg.vector_norm(
            flat(session, ref.full, session.param_order).double()))
        coef = min(1.0, max_norm / (total + thresholds.CLIP_EPSILON))
        if clip_would_bite(coef):
            hyps.append(compare.Hypothesis(
                KindId.CLIP_BEFORE_UNSCALE,
                f"the reference clipped at max_grad_norm={max_norm:g} and divided by the loss "
                f"scale S={scale:g} (the clip compared the threshold with S x the true norm)",
                full * (coef / scale), coef / scale, {"scale": scale, "clip_coefficient":
                                                      compare._round(coef)}))
    return hyps
