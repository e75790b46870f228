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
from typing import Any

from .. import deciders
from ..deciders import Observed
from ..enums import RungId, Severity, Status
from ..errors import AmpdoctorInterrupt
from ..evidence import Evidence
from ..findings import RungResult, location
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

    def on_alarm(signum, frame):
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


def timeout_result(rung: RungId, session, exc: RungTimeout) -> RungResult:
    seconds = session.spec.timeout_s
    site = session.finder.from_frame(exc.frame)
    last = exc.last
    where = f" The loop was at {site.file}:{site.line} ({site.function})." if site else ""
    seen = ""
    evidence: Evidence = {"timeout_s": seconds, "measured": seconds, "expected": None}
    if last is not None:
        at = f" at {last.site.file}:{last.site.line}" if last.site else ""
        seen = (f" The last call ampdoctor saw was {last.kind}{at}, after {last.backwards} "
                f"backward pass(es).")
        evidence.update({"last_event": last.kind, "backwards": last.backwards,
                         "microbatch": last.microbatch})
    finding = deciders.loop_error(Observed(rung, Severity.ERROR,
                      f"The {rung} rung did not finish within timeout_s = {seconds:g} s and was "
                      f"stopped.{where}{seen} A loop that never ends (a `while True` without "
                      "its exit, an iterator that never runs out) or a very slow one: raise "
                      "`timeout_s` in the spec if it is only slow.",
                      evidence=evidence, location=location(site)))
    return RungResult(rung, Status.FAIL, f"stopped after {seconds:g} s (timeout_s)", [finding])
