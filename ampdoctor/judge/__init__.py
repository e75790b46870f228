"""The judge: each update the optimizer consumed against the reference (DESIGN §3a).

For every optimizer step of a trace, teacher-forced: the reference gradient at the parameters
the step saw, over the micro-batches it consumed (`Trace.window_of_event`), clipped the way the
loop meant (`reference.clip_calls`), compared at the precision's tolerance. A clip that bit must
also have seen the reference's unclipped norm: clipping both to the same threshold would
otherwise hide any factor. The judge only measures; `rules` say why a step is off. It is the
only place where a gradient mismatch becomes bad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core import thresholds
from ..loading import micro_batch_counts
from ..maths import compare
from ..probe import spill
from ..reference import WindowReference
from ..reference.gradients import SESSION_WEIGHTING
from ..session import Session, Trace, flat
from . import step as judge_step
from .live import JudgedGradients, JudgedGroup, StepJudge, outside_the_loop
from .step import StepJudgement, known_thresholds, tolerance

__all__ = ["Judgement", "StepJudgement", "StepJudge", "JudgedGroup", "JudgedGradients",
           "judge", "judged_live", "step_groups", "tolerance", "known_thresholds",
           "weighting_of", "outside_the_loop"]


@dataclass(frozen=True)
class Judgement:
    precision: str
    tolerance: compare.Tolerance
    steps: tuple[StepJudgement, ...]
    #: micro-batches of different shapes and no `loss`: the count the loop weighs them by, found
    #: while judging (`weighting_of`); the rung driver gives it to the session
    weighting: str | None = None
    #: (step, n) of each short window (an epoch's last, n < K micro-batches) whose update is
    #: n/K of its window's mean: the loss divided by K there too (`short_window_over_k`)
    short_over_k: tuple[tuple[int, int], ...] = ()

    @property
    def first_bad(self) -> StepJudgement | None:
        return next((s for s in self.steps if s.bad), None)

    @property
    def worst_error(self) -> float:
        return max((s.metrics.rel_err for s in self.steps), default=0.0)

    def ratios(self) -> list[float]:
        """Each step's consumed/reference norm ratio, before any clip that bit."""
        out = []
        for s in self.steps:
            ratio = s.metrics.ratio
            if s.preclip_ratio is not None:
                ratio = s.preclip_ratio
            out.append(ratio)
        return out


def step_groups(trace: Trace) -> list[int]:
    seen: list[int] = []
    for step in trace.steps:
        if step.group not in seen:
            seen.append(step.group)
    return seen


def judged_live(trace: Trace) -> StepJudge | None:
    """The judge that judged `trace`'s steps as they happened, if one did."""
    observer = trace.step_observer
    return observer if isinstance(observer, StepJudge) else None


def judge(session: Session, trace: Trace, precision: str) -> Judgement:
    """Every optimizer step of `trace` against the reference, in order; the steps judged as
    they happened are taken as they were judged. Never changes the session: a weighting of
    the micro-batches found on the way is in the judgement (`Judgement.weighting`)."""
    ctx = judge_step.StepContext.of(session, trace, precision)
    eager = judged_live(trace)
    if eager is not None and eager.precision != precision:
        raise RuntimeError(f"a {eager.precision} run judged as it ran cannot be judged in "
                           f"{precision}")
    judged: list[StepJudgement] = []
    weighting: str | None = None
    over_k: list[tuple[int, int]] = []
    previous_seq = -1
    ended: int | None = None   # the window of the step group before
    for ordinal, group in enumerate(step_groups(trace)):
        steps = [s for s in trace.steps if s.group == group]
        past, before = trace.window_of_event(steps[0]), ended
        ended = past
        done = eager.groups.get(group) if eager is not None else None
        if done is not None:   # judged as it happened (`StepJudge`)
            if done.stop:
                break
            judged.extend(done.steps)
            previous_seq = max(s.seq for s in steps)
            continue
        snapshot = trace.snapshots.get(group)
        if snapshot is None:
            continue
        if judged and judged[-1].bad and not judge_step.finite_state(snapshot.state):
            break   # the run diverged after a bad step: nothing later can be compared
        # an epoch's short last window that no step consumed (a script's, whose windows the
        # reference told): this step is judged against it, the update the reference made there
        unstepped = trace.unstepped_window(before, past)

        if unstepped is not None and unstepped < session.N:
            window = unstepped
        else:
            if past is not None and past >= session.N and before is not None \
                    and (before >= session.N - 1 or getattr(trace, "bounds", None)):
                break   # a script read on past its N windows (an epoch's short last window
                #         ended them): nothing of its own in the reference
            window = session.window_of(steps[0], ordinal, trace)
        weighted = _weighting_arg(weighting)
        ref = session.reference(window, snapshot.state, snapshot.training, per_mb=False,
                                weighting=weighted)
        # the equal weighting of micro-batches that cannot form one batch is a guess: asked
        # (in fp32) at the first step of this reference that does not match
        ask = ref.guessed_weighting and precision == "fp32"
        for step in steps:
            events = judge_step.step_events(trace, step, previous_seq)
            verdict = judge_step.judge_one_step(ctx, ordinal, window, step, ref.full,
                                                events)
            if not verdict.metrics.ok and ask:
                ask = False
                names = [n for n in step.grads if n in session.param_shapes]
                found = weighting_of(session, window, ref, names,
                                     flat(session, step.grads, names), ctx.tol)
                if found is not None:
                    weighting = found
                    ref = session.reference(window, snapshot.state, snapshot.training,
                                            per_mb=False, weighting=weighting)
                    verdict = judge_step.judge_one_step(ctx, ordinal, window, step, ref.full,
                                                        events)
            if verdict.bad:
                verdict, n = short_window_over_k(ctx, verdict, ref.full, session.K)
                if n:
                    over_k.append((ordinal, n))
            judged.append(verdict)
        previous_seq = max(s.seq for s in steps)
    spill.forget_cache()   # the last step's copy read back from disk is not needed any more
    return Judgement(precision, ctx.tol, tuple(judged), weighting, tuple(over_k))


def short_window_over_k(ctx: judge_step.StepContext, verdict: StepJudgement,
                        reference: dict[str, torch.Tensor | None], K: int
                        ) -> tuple[StepJudgement, int]:
    """A step that consumed n < K micro-batches (an epoch's last, short window) and whose update
    is n/K of its window's mean -- the loss divided by K there as in every window, the
    convention of most loops and of accelerate's `backward` -- matches: each micro-batch weighs
    1/K, as in every full window (dividing by n instead, timm's way, matches the plain
    reference). Returns the verdict against the n/K reference and n when it matches, else the
    verdict as it was and 0. A full window 1/K off is never this (n = K)."""
    step = verdict.step
    n = len(step.consumed)
    if not 0 < n < K:
        return verdict, 0
    scaled = {k: None if v is None else v * (n / K) for k, v in reference.items()}
    events = list(verdict.events)
    again = judge_step.judge_one_step(ctx, verdict.ordinal, verdict.window, step, scaled, events)
    return (again, n) if not again.bad else (verdict, 0)


def _weighting_arg(found: str | None) -> str | None:
    """The `weighting` a reference is asked with: the one this judgement found, else the
    session's."""
    return SESSION_WEIGHTING if found is None else found


def weighting_of(session: Session, window: int, ref: WindowReference, names: list[str],
                 user: torch.Tensor, tol: compare.Tolerance) -> str | None:
    """Micro-batches of different shapes and no `loss`: the equal-weight reference is a guess.
    If the loop's gradient points exactly along the mean weighted by a count the micro-batches
    carry (their tokens, their non-ignored labels) and not along the equal-weight mean, the loop
    weighs micro-batches as one batch of the whole window would: that count, to weigh every
    reference by from now on (a wrong size is still judged against it); else None."""
    if not ref.per_mb:
        return None
    mbs = session.window(window)
    per = torch.stack([flat(session, g, names).double() for g in ref.per_mb])
    counts = [micro_batch_counts(mb) for mb in mbs]
    options: list[str | None] = [None] + [w for w in counts[0] if all(w in c for c in counts)]
    u = user.double()
    u_norm = float(torch.linalg.vector_norm(u))
    if u_norm == 0 or not math.isfinite(u_norm):
        return None

    def residual(what: str | None) -> float:
        weights = torch.tensor(session.fallback_weights(mbs, what), dtype=torch.float64)
        cand = weights @ per
        denom = float(cand @ cand)
        if denom == 0:
            return math.inf
        scale = float(u @ cand) / denom
        return float(torch.linalg.vector_norm(u - scale * cand)) / u_norm

    scored = sorted((residual(w), i, w) for i, w in enumerate(options))
    best_resid, _, best = scored[0]
    equal_resid = next(r for r, _, w in scored if w is None)
    if best is None or not weighting_wins(best_resid, equal_resid, tol.rtol):
        return None
    return best


def weighting_wins(residual: float, equal_residual: float, rtol: float) -> bool:
    """A count-weighted mean explains the loop's gradient (`residual`, relative, after the best
    scale) at a precision's `rtol`, and clearly better than the equal-weight mean does
    (thresholds.WEIGHTING_MARGIN)."""
    return not (residual > compare.hypothesis_tolerance(rtol)
                or residual > thresholds.WEIGHTING_MARGIN * equal_residual)
