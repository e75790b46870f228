"""Which GradScaler owned which loss and which optimizer, as one run saw it (no torch here).

Two GradScalers are two loss-scale state machines on one loss only when they act on the same
gradients: a `scaler.scale()` of a tensor another scale already multiplied, two scalers
unscaling or stepping one optimizer, or an optimizer's gradients holding a loss scaled by one
scaler when another unscales or steps them (they are multiplied by S1 and divided by S2). Two
scalers each scaling its own loss into its own optimizer's parameters (a GAN's generator and
discriminator) are two separate state machines, which is legitimate.

Fed the run's events in order: each enabled `Scale` adds its scaler to the *contributions* of
every optimizer whose parameters the loss reaches (`Scale.reaches`, read from the autograd
graph by the probe; a scaler's loss not read is taken to reach what its read ones reached); a
`zero_grad` clears its optimizer's contributions (a module's `zero_grad` clears them all: which
optimizer it belongs to is not known, and clearing can only spare a finding, never make one); an
`unscale_` or `step` by scaler s of optimizer o with a contribution of another scaler, or of an
optimizer another scaler already stepped, is a shared optimizer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..probe.events import Event, Scale, ScalerInit, ScalerStep, Unscale, ZeroGrad


@dataclass
class ScalerUse:
    """What one GradScaler did in the run."""

    slot: int
    file: str | None
    line: int | None
    scaled: int = 0                                   # enabled scale() calls
    stepped: set[int] = field(default_factory=set)    # optimizer slots unscaled or stepped
    reached: set[int] = field(default_factory=set)    # optimizer slots its losses reached

    def to_dict(self) -> dict[str, Any]:
        return {"scaler": self.slot, "file": self.file, "line": self.line,
                "scaled": self.scaled, "optimizers_stepped": sorted(self.stepped),
                "optimizers_reached": sorted(self.reached)}


@dataclass
class Ownership:
    """The run's enabled GradScalers and every place two of them met on one loss."""

    scalers: dict[int, ScalerUse]
    #: one entry per meeting: {"how": "scaled-twice" | "foreign-gradients" | "one-optimizer",
    #: "scalers" (the slots involved), "by" (the slot that scaled, unscaled or stepped),
    #: "optimizer" (its slot; None for scaled-twice)}
    shared: list[dict[str, Any]]

    def slots_at(self, file: str, line: int | None) -> list[int]:
        """The scalers built at `file`:`line` (every call of a function that builds one)."""
        where = os.path.realpath(file)
        return [s.slot for s in self.scalers.values()
                if s.file and os.path.realpath(s.file) == where and s.line == line]

    def to_dict(self) -> dict[str, Any]:
        return {"scalers": [s.to_dict() for s in self.scalers.values()], "shared": self.shared}


def ownership(events: list[Event], param_owner: dict[int, int]) -> Ownership:
    """Replay the run's GradScaler events (see the module docstring)."""
    replay = _Replay(events, param_owner)
    for e in events:
        if isinstance(e, Scale) and e.enabled:
            replay.scale(e)
        elif isinstance(e, (Unscale, ScalerStep)) and e.enabled and e.optimizer is not None:
            replay.step(e.scaler, e.optimizer)
        elif isinstance(e, ZeroGrad):
            if e.optimizer is None or e.owner != "optimizer":
                replay.contributions.clear()
            else:
                replay.contributions.pop(e.optimizer, None)
    return Ownership(replay.scalers, replay.shared)


class _Replay:
    def __init__(self, events: list[Event], param_owner: dict[int, int]):
        self.param_owner = param_owner
        self.scalers: dict[int, ScalerUse] = {
            e.scaler: ScalerUse(e.scaler, e.site.file if e.site else None,
                                e.site.line if e.site else None)
            for e in events if isinstance(e, ScalerInit) and e.enabled}
        #: each scaler's losses' optimizers, from the losses whose graph was read
        self.read: dict[int, set[int]] = {}
        for e in events:
            if isinstance(e, Scale) and e.enabled and e.reaches is not None:
                self.read.setdefault(e.scaler, set()).update(self._optimizers(e.reaches))
        #: optimizer slot -> the scalers whose losses its gradients hold (since its zero_grad)
        self.contributions: dict[int, set[int]] = {}
        self.stepped_by: dict[int, set[int]] = {}
        self.shared: list[dict[str, Any]] = []

    def _optimizers(self, leaves: tuple[int, ...]) -> set[int]:
        return {slot for pid in leaves if (slot := self.param_owner.get(pid)) is not None}

    def _use(self, slot: int) -> ScalerUse:
        return self.scalers.setdefault(slot, ScalerUse(slot, None, None))

    def _meet(self, how: str, slots: set[int], by: int, optimizer: int | None) -> None:
        entry = {"how": how, "scalers": sorted(slots), "by": by, "optimizer": optimizer}
        if entry not in self.shared:
            self.shared.append(entry)

    def scale(self, e: Scale) -> None:
        use = self._use(e.scaler)
        use.scaled += 1
        if e.input_already_scaled:
            self._meet("scaled-twice", {e.scaler}, e.scaler, None)
        reached = (self._optimizers(e.reaches) if e.reaches is not None
                   else self.read.get(e.scaler, set()))
        use.reached |= reached
        for slot in reached:
            self.contributions.setdefault(slot, set()).add(e.scaler)

    def step(self, scaler: int, optimizer: int) -> None:
        self._use(scaler).stepped.add(optimizer)
        others = self.contributions.get(optimizer, set()) - {scaler}
        if others:
            self._meet("foreign-gradients", others | {scaler}, scaler, optimizer)
        steppers = self.stepped_by.setdefault(optimizer, set())
        steppers.add(scaler)
        if len(steppers) > 1:
            self._meet("one-optimizer", set(steppers), scaler, optimizer)
