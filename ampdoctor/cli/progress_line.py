"""The diagnose's progress on stderr, fed by the events of `ampdoctor.core.progress`:
`rung 3/7 bf16-no-scaler · step 2/3 · ~40 s left`."""

from __future__ import annotations

from typing import Any

from rich.console import Console


def describe(event: dict[str, Any], steps: bool = True) -> str:
    """One progress event as a line: the rung and its place among the rungs that run, the
    optimizer step of the run in progress (`steps`), the time left once a rung has finished
    to go by (else the time so far)."""
    rung, precision, step = event.get("rung"), event.get("precision"), event.get("step")
    place = f"{event['rung_index']}/{event['rungs']} " \
        if event.get("rung_index") and event.get("rungs") else ""
    parts = [f"rung {place}{rung}"]
    if steps and precision is not None:
        if not step and not event.get("steps"):    # a run of a script starts: no step count
            parts.append(str(precision))
        else:
            of = f"/{event['steps']}" if event.get("steps") else ""
            parts.append(f"{precision} step {step}{of}")
    eta = event.get("eta_s")
    if isinstance(eta, (int, float)):
        parts.append(f"~{_seconds(eta)} left")
    else:
        parts.append(f"{event.get('elapsed_s', 0):.1f} s so far")
    return " · ".join(parts)


def _seconds(value: float) -> str:
    if value < 90:
        return f"{max(1, round(value))} s"
    return f"{value / 60:.0f} min"


class ProgressLine:
    """Progress on stderr: a live status line on a terminal; otherwise one line per rung, as
    it starts (a CI log gets a line per rung, not one per optimizer step)."""

    def __init__(self, err: Console, quiet: bool):
        self.err = err
        self.quiet = quiet
        self.status = err.status("loading the spec's code...") if err.is_terminal else None

    def __enter__(self) -> ProgressLine:
        if self.status is not None:
            self.status.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.status is not None:
            self.status.__exit__(*exc_info)

    def __call__(self, event: dict[str, Any]) -> None:
        if self.status is not None:
            self.status.update(describe(event))
            return
        if self.quiet:
            return
        if event.get("precision") is None:      # a rung starts: its one line
            self.err.print(f"  {describe(event, steps=False)}", highlight=False, markup=False)
