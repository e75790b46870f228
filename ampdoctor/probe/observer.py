"""What the probe offers the layers above it, declared on the observe side: the settings a run is
observed under (`ProbeSettings`), and the subscriber that sees each optimizer step as it happens
(`StepObserver`). The probe knows only these: who subscribes (the judge, judging each step as it
happens) is the rung driver's choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .events import StepRecord


@dataclass(frozen=True)
class ProbeSettings:
    """How the patched torch functions behave while ampdoctor runs the user's code (the loop
    and the reference's forwards), given by the session when a run or a reference starts."""

    #: `dropout: off`: every functional dropout (which nn.Dropout, nn.MultiheadAttention and
    #: the Transformer layers call) runs with p = 0, whatever `model.train()` says.
    dropout_off: bool = False
    #: Every enabled GradScaler built during the run starts from this scale instead of its
    #: init_scale (after the loop's own init_scale overflowed every step of the slice: the
    #: scaler's start-up search, which a short slice never gets past). None: its own.
    start_scale: float | None = None


@dataclass
class StepKeep:
    """What of a step its observer saw the probe must keep: the group's weights (`state`, a
    snapshot), and the step's gradients unless `names` is set (what the step record holds
    instead: the parameter names, the gradients themselves not kept)."""

    state: bool
    names: Mapping[str, Any] | None = None


class StepObserver(Protocol):
    """Sees each optimizer step of a run as it happens (set on `Probe.step_observer`).

    At the first step of a group (new gradients since the last step) the probe calls
    `begin_group` with the live weights; for the steps of a group it `observes`, the probe
    hands `on_step` the live gradients instead of copies and keeps what it answers; `copied`
    says the probe copied a step's gradients after all; `finish` ends the run.
    """

    def begin_group(self, group: int, consumed: tuple[int, ...],
                    state: Mapping[str, torch.Tensor], training: bool) -> bool:
        """A group starts at `state`: True when the observer takes it (no snapshot kept)."""
        ...

    def observes(self, group: int) -> bool:
        """Are this group's steps handed over live?"""
        ...

    def on_step(self, step: StepRecord) -> StepKeep:
        """A step of an observed group, its `grads` the live gradients: what to keep."""
        ...

    def copied(self, step: StepRecord) -> None:
        """The probe copied `step`'s gradients (as `on_step` asked)."""
        ...

    def finish(self) -> None:
        """The run is over."""
        ...


__all__ = ["ProbeSettings", "StepKeep", "StepObserver"]
