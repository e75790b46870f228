"""The diagnose's progress on stderr, fed by the events of `ampdoctor.progress`."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console


class ProgressLine:
    """Progress on stderr: a live status line on a terminal; otherwise one line per rung and
    at most one line a second per optimizer step (a CI log stays short)."""

    def __init__(self, err: Console, quiet: bool):
        self.err = err
        self.quiet = quiet
        self.status = err.status("loading the spec's code...") if err.is_terminal else None
        self.last_line = 0.0

    def __enter__(self) -> ProgressLine:
        if self.status is not None:
            self.status.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.status is not None:
            self.status.__exit__(*exc_info)

    def __call__(self, event: dict[str, Any]) -> None:
        rung, precision, step = event.get("rung"), event.get("precision"), event.get("step")
        elapsed = f"{event.get('elapsed_s', 0):.1f}s"
        if precision is None:
            text = f"rung {rung}  ({elapsed})"
        else:
            of = f"/{event['steps']}" if event.get("steps") else ""
            text = f"rung {rung}  {precision}  optimizer step {step}{of}  ({elapsed})"
        if self.status is not None:
            self.status.update(text)
            return
        if self.quiet:
            return
        now = time.monotonic()
        if precision is None or step == 0 or now - self.last_line >= 1.0:
            self.last_line = now
            self.err.print(f"  {text}", highlight=False, markup=False)
