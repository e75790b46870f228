"""The judge: each update the optimizer consumed against the reference (DESIGN §3a).

For every optimizer step of a trace, teacher-forced: the reference gradient at the parameters
the step saw, over the micro-batches it consumed (`Trace.window_of_event`), clipped the way the
loop meant (`reference.clip_calls`), compared at the precision's tolerance. A clip that bit must
also have seen the reference's unclipped norm: clipping both to the same threshold would
otherwise hide any factor. The judge only measures; `rules` say why a step is off. It is the
only place where a gradient mismatch becomes bad.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from . import compare
from .errors import AmpdoctorInterrupt
from .loading import micro_batch_counts
from .probe import recorder, spill
from .probe.events import Clip, ScalerStep
from .probe.observer import StepKeep
from .probe.recorder import Event, StepRecord
from .reference import ClipCall, WindowReference, clip_calls, clip_ops, reference_norm
from .reference.gradients import SESSION_WEIGHTING
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
    #: micro-batches of different shapes and no `loss`: the count the loop weighs them by, found
    #: while judging (`weighting_of`); the rung driver gives it to the session
    weighting: str | None = None

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
        known |= {e.max_norm for e in fp32.events_of(Clip)
                  if e.max_norm is not None}
    return {float(t) for t in known if math.isfinite(t)}


@dataclass
class _Context:
    """What judging a step of one trace needs besides the step and its reference."""

    session: Session
    trace: Trace
    precision: str
    tol: compare.Tolerance
    names_of: dict[int, str]
    owner: dict[int, int]
    known: set[float]

    @classmethod
    def of(cls, session: Session, trace: Trace, precision: str,
           known: set[float] | None = None) -> _Context:
        return cls(session, trace, precision, tolerance(session, precision),
                   trace.parameter_names(), trace.parameter_owners(),
                   known_thresholds(session, trace) if known is None else known)


def _step_events(trace: Trace, step: StepRecord, previous_seq: int) -> list[Event]:
    """The events that produced `step`: those since the previous step group's last step, or
    since the last skipped scaler.step before it (a skipped window consumed nothing: its clips
    and unscales are not this step's, the skip threw its gradients away)."""
    skips = [e.seq for e in trace.events_of(ScalerStep) if e.skipped
             and e.seq < step.seq]
    start = max([previous_seq] + skips)
    return [e for e in trace.events if start < e.seq < step.seq]


def _judge_step(ctx: _Context, ordinal: int, window: int, step: StepRecord,
                reference: dict[str, torch.Tensor | None], events: list[Event]) -> StepJudgement:
    """One step's consumed gradient against the reference (every parameter's unclipped
    gradient) clipped the way the loop meant; tensor by tensor, no flat copy of either."""
    session, precision, tol = ctx.session, ctx.precision, ctx.tol
    names = [n for n in step.grads if n in session.param_shapes]
    calls = clip_calls(ctx.names_of, events, ctx.owner, ctx.known)
    calls = _hand_clip(calls, ctx.trace, names, step.grads, reference, session, tol)
    # clipped over every parameter (a clip may cover more than the one optimizer whose step is
    # judged), compared over the step's own
    expected, _ = clip_ops(reference, session.param_order, calls)
    m = compare.metrics_of(step.grads, expected, names, session.param_shapes, tol)
    bad = not m.ok and not compare.is_precision_noise(m, precision)
    preclip = _preclip_ratio(reference, calls)
    if not bad and preclip is not None and precision in ("fp32", "bf16"):
        band = max(3 * tol.rtol, PRECLIP_BAND_FP32) if precision == "fp32" \
            else PRECLIP_BAND_BF16
        bad = abs(preclip - 1) > band
    return StepJudgement(ordinal, window, step, m, tuple(calls), preclip, tuple(events), bad)


def judged_live(trace: Trace) -> StepJudge | None:
    """The judge that judged `trace`'s steps as they happened, if one did."""
    observer = trace.step_observer
    return observer if isinstance(observer, StepJudge) else None


def judge(session: Session, trace: Trace, precision: str) -> Judgement:
    """Every optimizer step of `trace` against the reference, in order; the steps judged as
    they happened are taken as they were judged. Never changes the session: a weighting of
    the micro-batches found on the way is in the judgement (`Judgement.weighting`)."""
    ctx = _Context.of(session, trace, precision)
    eager = judged_live(trace)
    if eager is not None and eager.precision != precision:
        raise RuntimeError(f"a {eager.precision} run judged as it ran cannot be judged in "
                           f"{precision}")
    judged: list[StepJudgement] = []
    weighting: str | None = None
    previous_seq = -1
    for ordinal, group in enumerate(step_groups(trace)):
        steps = [s for s in trace.steps if s.group == group]
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
        if judged and judged[-1].bad and not _finite_state(snapshot.state):
            break   # the run diverged after a bad step: nothing later can be compared
        window = session.window_of(steps[0], ordinal, trace)
        weighted = _weighting_arg(weighting)
        ref = session.reference(window, snapshot.state, snapshot.training, per_mb=False,
                                weighting=weighted)
        # the equal weighting of micro-batches that cannot form one batch is a guess: asked
        # (in fp32) at the first step of this reference that does not match
        ask = ref.guessed_weighting and precision == "fp32"
        for step in steps:
            events = _step_events(trace, step, previous_seq)
            verdict = _judge_step(ctx, ordinal, window, step, ref.full, events)
            if not verdict.metrics.ok and ask:
                ask = False
                names = [n for n in step.grads if n in session.param_shapes]
                found = weighting_of(session, window, ref, names,
                                     flat(session, step.grads, names), ctx.tol)
                if found is not None:
                    weighting = found
                    ref = session.reference(window, snapshot.state, snapshot.training,
                                            per_mb=False, weighting=weighting)
                    verdict = _judge_step(ctx, ordinal, window, step, ref.full, events)
            judged.append(verdict)
        previous_seq = max(s.seq for s in steps)
    spill.forget_cache()   # the last step's copy read back from disk is not needed any more
    return Judgement(precision, ctx.tol, tuple(judged), weighting)


def _weighting_arg(found: str | None) -> str | None:
    """The `weighting` a reference is asked with: the one this judgement found, else the
    session's."""
    return SESSION_WEIGHTING if found is None else found


@dataclass
class JudgedGroup:
    """A step group judged as it happened, with the scalars the rules read instead of copies."""

    ordinal: int
    window: int
    #: each parameter's squared norm of the unclipped reference (`rules.scale_state`)
    ref_squares: dict[str, float]
    steps: list[StepJudgement] = field(default_factory=list)
    #: step seq -> each parameter's squared norm of the gradient it consumed
    grad_squares: dict[int, dict[str, float]] = field(default_factory=dict)
    #: the run diverged after a bad step: the judge stops before this group
    stop: bool = False

    def reference_norm(self, names) -> float:
        """The unclipped reference's 2-norm over `names`."""
        return math.sqrt(sum(self.ref_squares.get(n, 0.0) for n in names))

    def gradient_norm(self, seq: int, names) -> float:
        """The 2-norm over `names` of the gradient the step at event `seq` consumed."""
        return math.sqrt(sum(self.grad_squares[seq].get(n, 0.0) for n in names))


def _squares(grads) -> dict[str, float]:
    """Each parameter's squared 2-norm (a None gradient: 0)."""
    return {n: 0.0 if g is None else compare.sum_of_squares(g) for n, g in grads.items()}


class StepJudge:
    """Judge each optimizer step of a run while it happens (observe -> judge in one pass): the
    `probe.observer.StepObserver` the rung driver gives the session for the runs it judges.

    At the first step of a group, in the optimizer's pre-hook, the reference is computed at the
    live weights (outside the loop's autocast, grad mode and RNG stream, with the probe off) and
    each step is judged exactly as `judge` would after the run (`_judge_step`), against the live
    gradients. Nothing is copied for a step that matched, but for the gradients of the step
    before it (what a gradient not cleared carries over) and, in fp32, of the run's first step
    (the reproducibility rung's repeat run compares its own with them); the first bad step
    keeps its gradients and weights for the rules. So a run keeps two gradient copies at most,
    not two model copies per step on disk.

    Only for a run with one optimizer and a group whose window is known when it starts (the
    micro-batches its forwards consumed); any error here leaves the group to `judge` after the
    run, with the usual copies (a reference that fails then fails there, where it says so). A
    second optimizer the loop builds itself is seen at its first step: the group it steps in
    is judged here (the reference is held until the group ends), the later ones after the run.
    """

    def __init__(self, session: Session, trace: Trace, precision: str):
        self.session, self.trace, self.precision = session, trace, precision
        self.groups: dict[int, JudgedGroup] = {}
        self._reference: tuple[int, dict[str, torch.Tensor | None]] | None = None
        self._previous_seq = -1      # the previous group's last step
        self._last: StepJudgement | None = None
        self._bad_seen = False
        #: per optimizer, the last step whose gradients were copied
        self._kept: dict[int, StepRecord] = {}
        self.stopped = False
        self.failed = False

    def __deepcopy__(self, memo) -> StepJudge:
        # A loop that deep-copies its model (an EMA) copies the probe its hooks reach: the
        # session behind this judge (earlier runs' freed weights among it) is not the loop's.
        return self

    def begin_group(self, group: int, consumed: tuple[int, ...], state: dict[str, torch.Tensor],
                    training: bool) -> bool:
        """A new group starts at `state` (the live weights): True when it will be judged here,
        so the probe keeps no snapshot of it."""
        self._reference = None
        # the previous group's last step (this group's step is not recorded yet)
        self._previous_seq = max((s.seq for s in self.trace.steps), default=-1)
        if self.stopped:
            self.groups[group] = JudgedGroup(-1, -1, {}, stop=True)
            return True
        if self.failed or not consumed or len(self.trace.optimizers) > 1:
            # judged after the run from here on (the stop after a diverged bad step depends
            # on every step before it; a second optimizer the loop built itself steps on the
            # group's gradients from weights the first one changed: its group keeps them)
            self.failed = True
            return False
        session = self.session
        try:
            if self._last is not None and self._last.bad and not _finite_state(state):
                self.stopped = True
                self.groups[group] = JudgedGroup(-1, -1, {}, stop=True)
                return True
            window = max(0, min(max(consumed) // session.K, session.N - 1))
            ordinal = len({s.group for s in self.trace.steps})
            with outside_the_loop(session.device):
                ref = session.reference(window, state, training, per_mb=False)
            squares = _squares(ref.full)
        except (KeyboardInterrupt, AmpdoctorInterrupt):
            raise
        except Exception:
            self.failed = True   # (a reference that failed half-way keeps no gradients)
            return False
        self.groups[group] = JudgedGroup(ordinal, window, squares)
        self._reference = (group, ref.full)
        return True

    def observes(self, group: int) -> bool:
        """Are this group's steps judged here (the probe then hands over live gradients)?"""
        return group in self.groups

    def on_step(self, step: StepRecord) -> StepKeep:
        """Judge `step` (its `grads` the live gradients); say what the probe must copy. Never
        raises into the loop: on any error the step is left to the judge after the run."""
        try:
            return self._judge_one(step)
        except (KeyboardInterrupt, AmpdoctorInterrupt):
            raise
        except Exception:
            self.failed = True
            done = self.groups.get(step.group)
            if done is not None and done.steps:
                # an earlier step of the group was judged here and the group's weights are gone:
                # this step stays unjudged (its gradients kept), the group stays as judged
                return StepKeep(False)
            # judged after the run instead: it needs the group's weights and this gradient
            self.groups.pop(step.group, None)
            return StepKeep(True)

    def _judge_one(self, step: StepRecord) -> StepKeep:
        done = self.groups[step.group]
        dropped = StepKeep(False, JudgedGradients(step.grads, step.seq))
        if done.stop:
            return dropped
        if self._reference is None or self._reference[0] != step.group:
            raise RuntimeError("no reference for this group")
        known = known_thresholds(self.session, self.trace)
        if self.precision == "fp32" and "fp32" not in self.session.traces:
            # judged after the run, the fp32 run's own clips are known thresholds
            known |= {float(e.max_norm) for e in self.trace.events_of(Clip)
                      if e.max_norm is not None and math.isfinite(e.max_norm)}
        ctx = _Context.of(self.session, self.trace, self.precision, known)
        verdict = _judge_step(ctx, done.ordinal, done.window, step, self._reference[1],
                              _step_events(self.trace, step, self._previous_seq))
        done.grad_squares[step.seq] = _squares(step.grads)
        # (the reference is kept until the group ends: a second optimizer, or a second step,
        # may still step on the same gradients from weights the first step changed)
        done.steps.append(verdict)
        self._last = verdict
        if self._bad_seen:
            return dropped
        if verdict.bad:
            # its weights are the group's only at the group's first step (else the rules
            # explain it with the numbers alone)
            self._bad_seen = True
            return StepKeep(len(done.steps) == 1)
        # the same optimizer's previous copy is not needed any more (but the fp32 run's first
        # group: the repeat run compares with it)
        previous = self._kept.get(step.optimizer)
        first_group = self.trace.steps[0].group if self.trace.steps else step.group
        if previous is not None and not (self.precision == "fp32"
                                         and previous.group == first_group):
            previous.grads = JudgedGradients(previous.grads, previous.seq)
        return StepKeep(False)

    def copied(self, step: StepRecord) -> None:
        """The probe copied `step`'s gradients."""
        self._kept[step.optimizer] = step

    def finish(self) -> None:
        """The run is over: drop the reference."""
        self._reference = None


class JudgedGradients(Mapping):
    """The parameter names of a step judged as it happened, whose gradients were not kept.
    Reading one is a bug in ampdoctor, said loudly (never zeros)."""

    def __init__(self, names, seq: int):
        self._names = list(names)
        self._seq = seq

    def __getitem__(self, key: str):
        raise RuntimeError(f"the gradients of the step at event {self._seq} were judged as "
                           "they happened and not kept")

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@contextlib.contextmanager
def outside_the_loop(device: torch.device):
    """Run ampdoctor's own passes from inside the loop's optimizer step as if outside it: the
    probe off (nothing here is the loop's), grad mode on, no autocast, and the loop's RNG state
    (CPU and this CUDA device) left as it was."""
    with contextlib.ExitStack() as stack:
        previous = recorder.activate(None)
        stack.callback(recorder.activate, previous)
        cuda = (list(range(torch.cuda.device_count()))
                if torch.cuda.is_available() and torch.cuda.is_initialized() else [])
        stack.enter_context(torch.random.fork_rng(devices=cuda))   # ampdoctor seeds them all
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if device.type == "cuda":
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


def _finite_state(state: dict[str, torch.Tensor]) -> bool:
    return all(compare.all_finite(v) for v in state.values() if v.is_floating_point())


def _hand_clip(calls: list[ClipCall], trace: Trace, names: list[str], user, reference,
               session: Session, tol: compare.Tolerance) -> list[ClipCall]:
    """No clip call was seen but the loop was handed max_grad_norm: it may clip by hand
    (`p.grad.mul_(max_norm / norm)`). The reference then clips all parameters at that threshold,
    unless the unclipped reference fits the consumed gradient better."""
    threshold = trace.settings.max_grad_norm
    if calls or threshold is None or not math.isfinite(threshold):
        return calls
    hand = [ClipCall(None, "norm", tuple(names), 2.0, threshold, threshold, None, None)]
    clipped, _ = clip_ops(reference, names, hand)
    shapes = session.param_shapes
    if (compare.metrics_of(user, clipped, names, shapes, tol).rel_err
            <= compare.metrics_of(user, reference, names, shapes, tol).rel_err):
        return hand
    return calls


def _preclip_ratio(reference, calls: list[ClipCall]) -> float | None:
    """For the last norm clip that bit: the norm it saw (in true space) over the reference's
    unclipped norm of the same parameters."""
    biting = [c for c in calls if c.bit]
    if not biting:
        return None
    call = biting[-1]
    ref_norm = reference_norm(reference, call)
    seen = call.seen_true_norm
    if not ref_norm or seen is None:
        return None
    return seen / ref_norm


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
    if best is None or best_resid > max(3 * tol.rtol, 2e-3) or best_resid > 0.1 * equal_resid:
        return None
    return best
