"""The sentinel's cheap, exact checks (`ampdoctor.watch`): counts of calls per window, the
scaler's skips, judged as the ladder judges them, through the kinds' units."""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import thresholds
from ..core.findings import Finding, location
from ..kinds.frequent_skips import SteadySkips, steady_skips
from ..kinds.schedule import ScheduleOnSkips, StepsPerUpdate, schedule_on_skips, steps_per_update
from ..kinds.stepping import (
    OneBackwardPerStep,
    ZeroedInWindow,
    one_backward_per_step,
    zeroed_in_window,
)
from ..probe.callsite import CallSiteFinder, Site

#: `loss_fn(model, micro_batch)`: the micro-batch's mean loss (micro-batches weigh equally), or
#: a pair `(loss_sum, n_items)` (the window's loss is its sums over its items: tokens, samples)
LossFn = Callable[[torch.nn.Module, Any], Any]

#: the rung id of what the sentinel finds (a watched run has no ladder)
RUNG = "watch"
#: steps whose backward counts decide `step-per-microbatch` (a ragged last window of an
#: epoch is normal; a count of one on every one of these is not)
COUNT_WINDOWS = 3


@dataclass
class Window:
    """What happened since the last optimizer step (or skipped scaler step)."""

    backwards: int = 0
    backward_site: Site | None = None
    zero_grad_after: int | None = None        # backwards before the last zero_grad inside it
    zero_grad_site: Site | None = None
    unscaled: bool = False
    clip_norm: float | None = None            # what the clip returned (the pre-clip norm)
    clip_max: float | None = None
    clip_scaled: bool = False                 # the clip saw still-scaled gradients
    scheduler_steps: int = 0
    scheduler_site: Site | None = None
    scheduler_direct: bool = False            # that line called the scheduler itself
    batches: list[Any] = field(default_factory=list)
    rng: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    precision: str = "fp32"


class WatchState:
    """What the checks read and keep of the run (set by `Watch.__init__`; the mixins below
    share it)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    K: int
    scaler: Any
    scheduler: Any
    loss_fn: LossFn | None
    params: list[torch.Tensor]
    window: Window
    windows: int
    updates: int
    first_update_window: int | None
    skips: list[int]
    scheduler_on_skip: list[int]
    counts: list[int]
    scheduler_counts: list[int]
    checked: list[dict[str, Any]]
    notes: list[str]
    scheduler_site: Site | None
    scaler_site: Site | None
    _replaying: bool

    def _found(self, finding: Finding) -> None:
        raise NotImplementedError


class CountChecks(WatchState):
    """The checks made from counts when a window closes."""

    def _judge_counts(self, w: Window) -> None:
        if self.K > 1 and all(c == 1 for c in self.counts):
            self._found(one_backward_per_step(OneBackwardPerStep(
                RUNG, self.K, COUNT_WINDOWS, tuple(self.counts),
                location=location(w.backward_site))))

    def _zero_grad_inside(self, w: Window) -> None:
        self._found(zeroed_in_window(ZeroedInWindow(
            RUNG, self.updates, self.K, w.backwards, w.zero_grad_after,
            location=location(w.zero_grad_site))))

    def _judge_scheduler(self, w: Window) -> None:
        counts = self.scheduler_counts
        # once per micro-batch: K per window (K - 1 in the first, whose step ends it before
        # the last micro-batch's scheduler step)
        if self.K > 1 and all(c >= max(2, self.K - 1) for c in counts):
            self._found(steps_per_update(StepsPerUpdate(
                RUNG, type(self.scheduler).__name__, self.K, tuple(counts),
                location=location(w.scheduler_site))))

    def _judge_skips(self) -> None:
        """A scaler that keeps skipping after it settled, and a scheduler that advanced on
        the skips (by consequence: `kinds.schedule.schedule_on_skips`)."""
        first_real = self.first_update_window or 0
        steady = [s for s in self.skips if s > first_real]
        after = self.windows - first_real - 1
        if self.scaler is not None:
            sc = self.scaler
            finding = steady_skips(SteadySkips(
                RUNG, len(steady), after, float(sc.get_scale()), sc.get_growth_factor(),
                sc.get_growth_interval(), sc.get_backoff_factor(),
                location=location(self.scaler_site)))
            if finding is not None:
                self._found(finding)
        if self.scheduler is None or not self.scheduler_on_skip:
            return
        on_calibration = sum(1 for s in self.scheduler_on_skip if s < first_real)
        on_steady = sum(1 for s in self.scheduler_on_skip if s > first_real)
        finding = schedule_on_skips(ScheduleOnSkips(
            rung=RUNG, scheduler_type=type(self.scheduler).__name__,
            location=location(self.scheduler_site),
            calibration_skips=on_calibration, steady_skips=on_steady,
            steps_after_settling=after, scheduler_steps=self.updates + len(self.skips),
            real_updates=self.updates, lr_shift=0.0, lr_step=None, lr_used=None,
            lr_meant=None, tolerance=thresholds.FP16_RTOL, own_scaler=True))
        if finding is not None:
            self._found(finding)


def built_at(obj: Any, frame: Any, finder: CallSiteFinder) -> Site | None:
    """Where the user's code built `obj`: in the first of the user's frames above `frame`
    that holds it in a variable, the line of the assignment to that variable (read with
    `ast` from the function's source)."""
    while frame is not None:
        code = frame.f_code
        if not finder._classify(code.co_filename)[0]:
            names = {name for name, value in frame.f_locals.items() if value is obj}
            if names:
                with contextlib.suppress(OSError, TypeError, SyntaxError):
                    lines, start = inspect.getsourcelines(code)
                    start = max(start, 1)
                    tree = ast.parse(textwrap.dedent("".join(lines)))
                    for node in ast.walk(tree):
                        if isinstance(node, ast.Assign) and any(
                                isinstance(t, ast.Name) and t.id in names for t in node.targets):
                            return Site(code.co_filename, start + node.lineno - 1,
                                        code.co_name)
                return None
        frame = frame.f_back
    return None


