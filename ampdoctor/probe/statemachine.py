"""The step state machine of the article's section 16, as a small pure class.

Fed the probe's events in order, one state per optimizer:

    READY --unscale_--> UNSCALED --step--> STEPPED --update--> READY

with `clip` legal only in UNSCALED while a scaler is enabled, a direct `optimizer.step()` legal
only on unscaled gradients, and one `update` per optimizer step. Each illegal transition becomes
a `Violation` carrying the event (and so the user's call site) that made it. The machine names
the illegal transition (`Illegal`), not a diagnosis: which kind it explains, and how badly, is
for the rules and the kinds' units to say.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.enums import StrEnum
from .events import Backward, Clip, Event, OptimizerStep, Scale, ScalerStep, Unscale, Update

READY, UNSCALED, STEPPED = "READY", "UNSCALED", "STEPPED"


class Illegal(StrEnum):
    """The illegal transitions of the step state machine."""

    SCALE_OF_SCALED = "scale() of an already scaled loss"
    SECOND_UNSCALE = "a second unscale_() in one step"
    CLIP_WHILE_SCALED = "a clip of still scaled gradients"
    STEP_WHILE_SCALED = "a direct step() on still scaled gradients"
    UPDATE_WITHOUT_STEP = "an update() with no step since the last"


@dataclass
class Violation:
    kind: Illegal
    event: Event
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


class StepStateMachine:
    """Checks scale -> backward xK -> unscale_ -> clip -> step -> update -> zero_grad."""

    def __init__(self, param_owner: dict[int, int] | None = None):
        #: id(param) -> optimizer slot, to know whose gradients a clip touched.
        self.param_owner = param_owner or {}
        self.state: dict[int | None, str] = {}
        self.scaled_backward = False      # a backward of a scaled loss since the last update
        self.steps_since_update = 0
        self.unscaled_by_hand: set[int] = set()
        self.violations: list[Violation] = []
        self.updates = 0
        #: event type -> its transition
        self._handlers: dict[type[Event], Callable[[Any], None]] = {
            Scale: self.on_scale, Backward: self.on_backward, Unscale: self.on_unscale,
            Clip: self.on_clip, ScalerStep: self.on_scaler_step, OptimizerStep: self.on_step,
            Update: self.on_update}

    def _get(self, slot: int | None) -> str:
        return self.state.setdefault(slot, READY)

    def _violate(self, kind: Illegal, event: Event, detail: str, **data: Any) -> None:
        self.violations.append(Violation(kind, event, detail, data))

    def feed(self, event: Event) -> None:
        """One event, dispatched by its type (the others change no state)."""
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def feed_all(self, events: list[Event]) -> list[Violation]:
        for event in events:
            self.feed(event)
        return self.violations

    # --- transitions ----------------------------------------------------------------------
    def on_scale(self, event: Scale) -> None:
        if not event.enabled:
            return
        if event.input_already_scaled:
            self._violate(Illegal.SCALE_OF_SCALED, event,
                          "scaler.scale() was given a tensor that was already scaled",
                          first_scale=event.input_already_scaled,
                          scale=event.scale)

    def on_backward(self, event: Backward) -> None:
        if event.scaled_by is not None:
            self.scaled_backward = True

    def on_unscale(self, event: Unscale) -> None:
        if not event.enabled:
            return
        slot = event.optimizer
        state = self._get(slot)
        if event.inside_step and state == READY:
            self.state[slot] = UNSCALED      # scaler.step unscales for you: legal
            return
        if state == UNSCALED:
            self._violate(Illegal.SECOND_UNSCALE, event,
                          "unscale_() called twice on the same optimizer in one step")
        self.state[slot] = UNSCALED

    def on_clip(self, event: Clip) -> None:
        if not self.scaled_backward:
            return
        owners = {slot for pid in event.param_ids
                  if (slot := self.param_owner.get(pid)) is not None}
        for slot in sorted(owners):
            if self._get(slot) == READY:
                self._violate(Illegal.CLIP_WHILE_SCALED, event,
                              "clip_grad_norm_ ran on gradients that were still scaled",
                              optimizer=slot, total_norm=event.total_norm,
                              max_norm=event.max_norm)
                return

    def on_scaler_step(self, event: ScalerStep) -> None:
        self.state[event.optimizer] = STEPPED
        self.steps_since_update += 1

    def on_step(self, event: OptimizerStep) -> None:
        slot = event.optimizer
        if event.via_scaler:
            return
        if self.scaled_backward and self._get(slot) == READY:
            self._violate(Illegal.STEP_WHILE_SCALED, event,
                          "optimizer.step() ran on gradients still multiplied by the loss scale",
                          optimizer=slot)
        self.state[slot] = STEPPED
        self.steps_since_update += 1

    def on_update(self, event: Update) -> None:
        self.updates += 1
        if self.steps_since_update == 0:
            self._violate(Illegal.UPDATE_WITHOUT_STEP, event,
                          "scaler.update() ran with no optimizer step since the last update")
        self.steps_since_update = 0
        self.scaled_backward = False
        for slot in self.state:
            self.state[slot] = READY
