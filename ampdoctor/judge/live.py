"""Judging each optimizer step of a run while it happens (`StepJudge`): the observer of the
probe's steps (`probe.observer.StepObserver`) that the rung driver gives the session for the
runs it judges, so that a run keeps scalars instead of per-step copies of the model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ..core import memory
from ..core.errors import AmpdoctorInterrupt
from ..maths import compare
from ..probe import recorder, spill
from ..probe.events import Clip, StepRecord
from ..probe.observer import StepKeep
from ..session import Session, Trace
from . import step as judge_step
from .step import StepJudgement, known_thresholds


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

    def reference_norm(self, names: Iterable[str]) -> float:
        """The unclipped reference's 2-norm over `names`."""
        return math.sqrt(sum(self.ref_squares.get(n, 0.0) for n in names))

    def gradient_norm(self, seq: int, names: Iterable[str]) -> float:
        """The 2-norm over `names` of the gradient the step at event `seq` consumed."""
        return math.sqrt(sum(self.grad_squares[seq].get(n, 0.0) for n in names))


def _squares(grads: Mapping[str, torch.Tensor | None]) -> dict[str, float]:
    """Each parameter's squared 2-norm (a None gradient: 0)."""
    return {n: 0.0 if g is None else compare.sum_of_squares(g) for n, g in grads.items()}


class StepJudge:
    """Judge each optimizer step of a run while it happens (observe -> judge in one pass): the
    `probe.observer.StepObserver` the rung driver gives the session for the runs it judges.

    At the first step of a group, in the optimizer's pre-hook, the reference is computed at the
    live weights (outside the loop's autocast, grad mode and RNG stream, with the probe off) and
    each step is judged exactly as `judge` would after the run (`judge_step.judge_one_step`),
    against the live gradients. Nothing is copied for a step that matched, but for the
    gradients of the step before it (what a gradient not cleared carries over) and, in fp32, of
    the run's first step (the reproducibility rung's repeat run compares its own with them);
    the first bad step keeps its gradients and weights for the rules. So a run keeps two
    gradient copies at most, not two model copies per step on disk.

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

    def __deepcopy__(self, memo: dict[int, Any]) -> StepJudge:
        # A loop that deep-copies its model (an EMA) copies the probe its hooks reach: the
        # session behind this judge (earlier runs' freed weights among it) is not the loop's.
        return self

    def begin_group(self, group: int, consumed: tuple[int, ...], state: Mapping[str, torch.Tensor],
                    training: bool) -> bool:
        """A new group starts at `state` (the live weights): True when it will be judged here,
        so the probe keeps no snapshot of it."""
        self._reference = None
        # The previous group's reference is freed: its pages go back to the system before this
        # group's is computed. The heap would keep them (each step of a run would hold the
        # freed pages of the last step's reference besides its own), and a run's last steps,
        # where its optimizer state is alive too, are a diagnose's peak: measured on the wide
        # benchmark model, 80-115 MB less at the bf16 and fp16 runs' last steps (bench/README.md).
        memory.trim()
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
            if self._last is not None and self._last.bad and not judge_step.finite_state(state):
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
        except Exception:  # noqa: BLE001 - the ladder's judge decides; live judging stops
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
        except Exception:  # noqa: BLE001 - the ladder's judge decides; live judging stops
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
        ctx = judge_step.StepContext.of(self.session, self.trace, self.precision, known)
        events = judge_step.step_events(self.trace, step, self._previous_seq)
        verdict = judge_step.judge_one_step(ctx, done.ordinal, done.window, step,
                                            self._reference[1], events)
        done.grad_squares[step.seq] = _squares(step.grads)
        # (the reference is kept until the group ends: a second optimizer, or a second step,
        # may still step on the same gradients from weights the first step changed)
        done.steps.append(verdict)
        self._last = verdict
        if self._bad_seen:
            # (but the fp32 run's first group: the repeat run compares every step of it; its
            # gradients kept, not the weights, which the group's earlier step changed)
            first_group = self.trace.steps[0].group if self.trace.steps else step.group
            return StepKeep(False) if (self.precision == "fp32"
                                       and step.group == first_group) else dropped
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
        """The probe copied `step`'s gradients. The fp32 run's first group keeps them to the
        end of the run and past it (the repeat run compares with them): on disk, so they are
        not in memory through the run's later groups, when the optimizer state is too (a
        large copy; a small one stays)."""
        self._kept[step.optimizer] = step
        first_group = self.trace.steps[0].group if self.trace.steps else step.group
        if self.precision == "fp32" and step.group == first_group:
            step.grads = spill.to_disk(step.grads)

    def finish(self) -> None:
        """The run is over: drop the reference."""
        self._reference = None


class JudgedGradients(Mapping):
    """The parameter names of a step judged as it happened, whose gradients were not kept.
    Reading one is a bug in ampdoctor, said loudly (never zeros)."""

    def __init__(self, names: Iterable[str], seq: int) -> None:
        self._names = list(names)
        self._seq = seq

    def __getitem__(self, key: str) -> NoReturn:
        raise RuntimeError(f"the gradients of the step at event {self._seq} were judged as "
                           "they happened and not kept")

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@contextlib.contextmanager
def outside_the_loop(device: torch.device) -> Iterator[None]:
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
