"""Progress of a diagnose, for the CLI's stderr line: which rung (its place among the rungs
that will run), which precision, which optimizer step of the run in progress, and an estimate
of the time left from the rungs run so far. The probe reports each optimizer step it sees
through `optimizer_stepped()`; nothing is reported (and nothing costs) when no listener is
set."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_listener: Callable[[dict[str, Any]], None] | None = None
_state: dict[str, Any] = {}


@contextmanager
def listening(listener: Callable[[dict[str, Any]], None] | None) -> Iterator[None]:
    global _listener
    previous, _listener = _listener, listener
    _state.clear()
    _state["started"] = time.monotonic()
    try:
        yield
    finally:
        _listener = previous


def plan(rung_ids: list[str], weights: dict[str, float] | None = None) -> None:
    """The rungs this diagnose will run, in order (the others are skipped by the spec), and
    each one's expected cost relative to the others (1 each when not given)."""
    _state["plan"] = list(rung_ids)
    _state["weights"] = {r: float((weights or {}).get(r, 1.0)) for r in rung_ids}
    _state["finished"] = []


def rung(rung_id: str) -> None:
    now = time.monotonic()
    if "rung_started" in _state:        # the rung before this one has finished
        _state.setdefault("finished", []).append(now - _state["rung_started"])
    _state["rung"] = rung_id
    _state["rung_started"] = now
    _emit(precision=None, step=0, steps=None)


def eta_s(finished: list[float], remaining: float, current_s: float,
          finished_weight: float | None = None) -> float | None:
    """Seconds left: the time per unit of cost of the rungs finished so far times the cost of
    the rungs not yet finished (`remaining`, the current one included), less the time the
    current one has run; None before a rung has finished (nothing to go by). Without
    `finished_weight` every rung costs 1."""
    if not finished:
        return None
    done = finished_weight if finished_weight is not None else float(len(finished))
    if done <= 0:
        return None
    return max(0.0, sum(finished) / done * remaining - current_s)


def run_started(precision: str, steps: int | None) -> None:
    """A run of the user's loop begins (`steps` optimizer steps planned)."""
    _state.update(precision=precision, steps=steps, done=0)
    if _listener is not None:
        _emit(precision=precision, step=0, steps=steps)


def optimizer_stepped() -> None:
    """The run in progress took one more optimizer step (the first optimizer's)."""
    if _listener is None:
        return
    _state["done"] = _state.get("done", 0) + 1
    _emit(precision=_state.get("precision"), step=_state["done"], steps=_state.get("steps"))


def _emit(**fields: Any) -> None:
    if _listener is None:
        return
    now = time.monotonic()
    event = {"rung": _state.get("rung"), **fields,
             "elapsed_s": round(now - _state.get("started", now), 1)}
    plan_ids = _state.get("plan") or []
    if _state.get("rung") in plan_ids:
        index = plan_ids.index(_state["rung"])
        weights = _state.get("weights") or {}
        finished = _state.get("finished") or []
        left = eta_s(finished, sum(weights.get(r, 1.0) for r in plan_ids[index:]),
                     now - _state.get("rung_started", now),
                     sum(weights.get(r, 1.0) for r in plan_ids[:len(finished)]))
        event.update(rung_index=index + 1, rungs=len(plan_ids),
                     eta_s=None if left is None else round(left, 1))
    with contextlib.suppress(Exception):   # a broken progress display never stops a diagnose
        _listener(event)
