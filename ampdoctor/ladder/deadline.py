"""A rung's time bound (spec key `timeout_s`): a loop that hangs is stopped, and the finding says
where it was.

The bound is an interval timer (SIGALRM) in the main thread: its handler raises `RungTimeout`
where the loop is, between two Python bytecodes (a long torch call finishes first). It derives
from BaseException so that the loop's own `except Exception` cannot swallow it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from ..core.enums import RungId, Status
from ..core.errors import AmpdoctorInterrupt
from ..core.findings import RungResult, location
from ..kinds.loop_error import RungTimedOut, rung_timed_out
from ..probe import recorder

#: Seconds between repeated alarms once the deadline has passed.
REFIRE_S = 0.5


class RungTimeout(AmpdoctorInterrupt):
    """The rung ran past `timeout_s`. `site`: where the loop was; `last`: its last event."""

    def __init__(self, frame: Any, last: Any) -> None:
        super().__init__("rung timeout")
        self.frame = frame
        self.last = last


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    usable = (seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable or seconds is None:
        yield
        return

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        # An exception raised where it is swallowed (a __del__, a gc callback) would be lost:
        # fire again shortly until one reaches the rung (the finally below disarms).
        signal.setitimer(signal.ITIMER_REAL, REFIRE_S)
        probe = recorder.ACTIVE
        raise RungTimeout(frame, probe.events[-1] if probe is not None and probe.events else None)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timeout_result(rung: RungId, session: Any, exc: RungTimeout) -> RungResult:
    # session: a Session or a script's ScriptSession (duck-typed), as `run_ladder` is given
    seconds = session.spec.timeout_s
    site = session.finder.from_frame(exc.frame)
    last = exc.last
    finding = rung_timed_out(RungTimedOut(
        rung, seconds, loop_site=location(site),
        last_call=last.kind if last is not None else None,
        last_site=location(last.site) if last is not None else None,
        backwards=last.backwards if last is not None else 0,
        microbatch=last.microbatch if last is not None else None))
    return RungResult(rung, Status.FAIL, f"stopped after {seconds:g} s (timeout_s)", [finding])
