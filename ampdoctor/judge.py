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

from . import compare
from .probe import spill
from .probe.recorder import Event, StepRecord
from .reference import ClipCall, apply_clips, clip_calls, reference_norm
from .loading import micro_batch_counts
from .session import Session, Trace, flat
from .thresholds import PRECLIP_BAND_BF16, PRECLIP_BAND_FP32


@dataclass(frozen=True)
class StepJudgement:
    """One optimizer step against the reference."""

    ordinal: int                   # the step group's position in the run
    window: int                    # the window of micro-batches it consumed
    step: StepRecord
    metrics: compare.Metrics       # consumed vs clipped reference
    clips: tuple[ClipCall, ...]
    preclip_ratio: float | None    # norm a clip that bit saw / the reference's unclipped norm
    events: tuple[Event, ...]      # the events since the previous step
    bad: bool

    @property
    def names(self) -> list[str]:
        return list(self.step.grads)


@dataclass(frozen=True)
class Judgement:
    precision: str
    tolerance: compare.Tolerance
    steps: tuple[StepJudgement, ...]

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


def tolerance(session: Session, precision: str) -> compare.Tolerance:
    default = compare.DEFAULT_TOLERANCES[precision]
    override = session.spec.tolerances.get(precision)  # type: ignore[call-overload]
    if override is None:
        return default
    return compare.Tolerance(override.rtol if override.rtol is not None else default.rtol,
                             override.atol if override.atol is not None else default.atol)


def step_groups(trace: Trace) -> list[int]:
    seen: list[int] = []
    for step in trace.steps:
        if step.group not in seen:
            seen.append(step.group)
    return seen


def known_thresholds(session: Session, trace: Trace) -> set[float]:
    """The clip thresholds the loop means: its run's max_grad_norm and whatever its fp32 run
    passed (a loop may clip at its own fixed threshold instead of run.max_grad_norm)."""
    known = {trace.settings.max_grad_norm} - {None}
    fp32 = session.traces.get("fp32")
    if fp32 is not None:
        known |= {e.max_norm for e in fp32.of_kind("clip")
                  if e.max_norm is not None}
    return {float(t) for t in known if math.isfinite(t)}


def judge(session: Session, trace: Trace, precision: str) -> Judgement:
    tol = tolerance(session, precision)
    model = trace.probe.model
    names_of = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    owner = {id(p): slot for slot, opt in enumerate(trace.probe.optimizers)
             for group in opt.param_groups for p in group["params"]}
    known = known_thresholds(session, trace)
    sizes = {n: math.prod(shape) for n, shape in session.param_shapes.items()}
    judged: list[StepJudgement] = []
    previous_seq = -1
    skips = [e for e in trace.of_kind("scaler_step") if e.skipped]
    for ordinal, group in enumerate(step_groups(trace)):
        steps = [s for s in trace.steps if s.group == group]
        snapshot = trace.probe.snapshots.get(group)
        if snapshot is None:
            continue
        if judged and judged[-1].bad and not _finite_state(snapshot.state):
            break   # the run diverged after a bad step: nothing later can be compared
        window = session.window_of(steps[0], ordinal, trace)
        ref = session.reference(window, snapshot.state, snapshot.training, per_mb=False)
        ref_every = flat(session, ref.full, session.param_order)
        for step in steps:
            names = [n for n in step.grads if n in session.param_shapes]
            # a window scaler.step skipped consumed nothing: its clips and unscales are not
            # this step's (the skip threw its gradients away)
            start = max([previous_seq] + [e.seq for e in skips if e.seq < step.seq])
            events = [e for e in trace.events if start < e.seq < step.seq]
            calls = clip_calls(names_of, events, owner, known)
            user = flat(session, step.grads, names)
            calls = _hand_clip(calls, trace, names, user,
                               lambda: _restrict(session, ref_every, names, sizes), sizes, tol)
            expected = _clipped_reference(session, ref_every, names, sizes, calls)
            m = compare.metrics(user, expected, tol)
            if not m.ok and session.weighting_open and precision == "fp32" \
                    and adopt_weighting(session, window, ref, names, user, tol):
                ref = session.reference(window, snapshot.state, snapshot.training,
                                        per_mb=False)
                ref_every = flat(session, ref.full, session.param_order)
                expected = _clipped_reference(session, ref_every, names, sizes, calls)
                m = compare.metrics(user, expected, tol)
            bad = not m.ok and not compare.is_precision_noise(m, precision)
            preclip = _preclip_ratio(session, ref_every, names, sizes, calls)
            del expected
            if not bad and preclip is not None and precision in ("fp32", "bf16"):
                band = max(3 * tol.rtol, PRECLIP_BAND_FP32) if precision == "fp32" \
                    else PRECLIP_BAND_BF16
                bad = abs(preclip - 1) > band
            judged.append(StepJudgement(ordinal, window, step, m, tuple(calls), preclip,
                                        tuple(events), bad))
        previous_seq = max(s.seq for s in steps)
    spill.forget_cache()   # the last step's copy read back from disk is not needed any more
    return Judgement(precision, tol, tuple(judged))


def _restrict(session: Session, vector: torch.Tensor, names: list[str],
              sizes: dict[str, int]) -> torch.Tensor:
    """A vector flattened over every parameter (`session.param_order`), restricted to `names`
    (the vector itself when `names` are all of them, in that order)."""
    every = session.param_order
    if names == every:
        return vector
    offsets, offset = {}, 0
    for name in every:
        offsets[name] = (offset, offset + sizes[name])
        offset += sizes[name]
    parts = [vector[slice(*offsets[n])] for n in names]
    return torch.cat(parts) if parts else vector[:0]


def _clipped_reference(session: Session, ref_every: torch.Tensor, names: list[str],
                       sizes: dict[str, int], calls: list[ClipCall]) -> torch.Tensor:
    """The reference (flattened over every parameter) clipped as the loop meant, over every
    parameter (a clip may cover more than the one optimizer whose step is judged), then
    restricted to `names`."""
    clipped, _ = apply_clips(ref_every, session.param_order, sizes, calls)
    return _restrict(session, clipped, names, sizes)


def _finite_state(state: dict[str, torch.Tensor]) -> bool:
    return all(compare.all_finite(v) for v in state.values() if v.is_floating_point())


def _hand_clip(calls: list[ClipCall], trace: Trace, names: list[str], user: torch.Tensor,
               reference_of, sizes: dict[str, int],
               tol: compare.Tolerance) -> list[ClipCall]:
    """No clip call was seen but the loop was handed max_grad_norm: it may clip by hand
    (`p.grad.mul_(max_norm / norm)`). The reference then clips all parameters at that threshold,
    unless the unclipped reference fits the consumed gradient better."""
    threshold = trace.settings.max_grad_norm
    if calls or threshold is None or not math.isfinite(threshold):
        return calls
    hand = [ClipCall(None, "norm", tuple(names), 2.0, threshold, threshold, None, None)]
    reference = reference_of()
    clipped, _ = apply_clips(reference, names, sizes, hand)
    if compare.metrics(user, clipped, tol).rel_err <= compare.metrics(user, reference, tol).rel_err:
        return hand
    return calls


def _preclip_ratio(session: Session, ref_every: torch.Tensor, names: list[str],
                   sizes: dict[str, int], calls: list[ClipCall]) -> float | None:
    """For the last norm clip that bit: the norm it saw (in true space) over the reference's
    unclipped norm of the same parameters."""
    biting = [c for c in calls if c.bit]
    if not biting:
        return None
    call = biting[-1]
    every = session.param_order
    ref_norm = reference_norm(ref_every, every, sizes, call)
    seen = call.seen_true_norm
    if not ref_norm or seen is None:
        return None
    return seen / ref_norm


def adopt_weighting(session: Session, window: int, ref, names: list[str],
                     user: torch.Tensor, tol: compare.Tolerance) -> bool:
    """Micro-batches of different shapes and no `loss`: the equal-weight reference is a guess.
    If the loop's gradient points exactly along the mean weighted by a count the micro-batches
    carry (their tokens, their non-ignored labels) and not along the equal-weight mean, the loop
    weighs micro-batches as one batch of the whole window would: adopt that weighting for every
    reference from now on (a wrong size is still judged against it). Asked once, in fp32."""
    session.weighting_open = False
    if not ref.per_mb:
        return False
    mbs = session.window(window)
    per = torch.stack([flat(session, g, names).double() for g in ref.per_mb])
    counts = [micro_batch_counts(mb) for mb in mbs]
    options: list[str | None] = [None] + [w for w in counts[0] if all(w in c for c in counts)]
    u = user.double()
    u_norm = float(torch.linalg.vector_norm(u))
    if u_norm == 0 or not math.isfinite(u_norm):
        return False

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
    if best is None or best_resid > max(3 * tol.rtol, 2e-3) or best_resid > 0.1 * equal_resid:
        return False
    session.adopt_weighting(best)
    return True
