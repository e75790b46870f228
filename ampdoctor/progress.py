"""Progress of a diagnose, for the CLI's stderr line: which rung, which precision, which
optimizer step of the run in progress. The probe reports each optimizer step it sees through
`step()`; nothing is reported (and nothing costs) when no listener is set."""

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


def rung(rung_id: str) -> None:
    _state["rung"] = rung_id
    _emit(precision=None, step=0, steps=None)


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
    event = {"rung": _state.get("rung"), **fields,
             "elapsed_s": round(time.monotonic() - _state.get("started", time.monotonic()), 1)}
    with contextlib.suppress(Exception):   # a broken progress display never stops a diagnose
        _listener(event)
