"""The kind of a loop that raised or hung: `loop-error`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

from ..core.enums import KindId, Severity
from ..core.evidence import Evidence
from ..core.findings import Finding, Location
from .base import Kind, Observed

LOOP_ERROR = Kind(
    KindId.LOOP_ERROR,
    title="The training loop raised an error",
    why=(
        "The loop raised an exception ampdoctor does not recognise as one of the known mistakes "
        "(or hung past `timeout_s`, or a DDP rank raised or hung)."),
    fix=(
        "Fix the error at the reported line (`evidence.loop_line` is the loop's own line that "
        "called it; `--debug` prints the full traceback); run the loop alone on the same slice to "
        "reproduce it. For a timeout that is only slowness, raise `timeout_s` in the spec."),
    example=(
        "for x, y in micro_batches:\n"
        "    with torch.autocast(run.device_type, dtype=run.autocast_dtype,\n"
        "                        enabled=run.autocast_dtype is not None):\n"
        "        x = torch.cat([x[:, :-1], torch.ones(len(x), 2)], 1)  # wrong width\n"
        "        loss = criterion(model(x), y) / K"),
    error_when="the loop raised or hung: nothing after it can be judged (exit 3).",
    measured="the exception the loop raised",
    decided_in=f"{__name__}:loop_error",
)


def loop_error(seen: Observed) -> Finding:
    """`loop-error`: the training loop raised an error.
    Error: the loop raised or hung (exit 3). (`LOOP_ERROR.error_when`)"""
    return Finding(seen.rung, KindId.LOOP_ERROR, seen.severity, **seen.fields(LOOP_ERROR))


# --- what a rung saw of a loop that raised, exited or hung ------------------------------------


def _at(site: Location | None) -> str:
    return f"{site.file}:{site.line}" if site is not None else ""


@dataclass(frozen=True)
class UpdateMissing:
    """torch refused unscale_() because the previous window never reached scaler.update():
    the updates and scaler.step calls of the run."""

    rung: str
    precision: str
    error: str
    updates: int
    scaler_steps: int
    location: Location | None = None


def no_update_before_unscale(o: UpdateMissing) -> Finding:
    """`loop-error` for a skip path without scaler.update(): the loop stopped (exit 3)."""
    return loop_error(Observed(o.rung, Severity.ERROR,
        f"In the {o.precision} run torch refused unscale_(): the previous "
        "window never reached scaler.update() (a skip path that returns early, "
        "or no update at all), so the next window's unscale_ counts as a second "
        "one. Call scaler.update() once per window on every path, skipped or not.",
        evidence={"error": o.error, "updates": o.updates, "scaler_steps": o.scaler_steps,
                  "measured": o.updates, "expected": o.scaler_steps or 1},
        location=o.location,
        fix="Call `scaler.update()` once per window on every path. Where the loop skips a "
            "window itself (a non-finite norm, then `continue`), call `scaler.update()` before "
            "leaving it, or drop the check: `scaler.step(optimizer)` already skips a step "
            "whose gradients are not finite."))


@dataclass(frozen=True)
class LoopExited:
    """The loop called sys.exit (its code, quoted)."""

    rung: str
    precision: str
    code: str
    location: Location | None = None


def loop_exited(o: LoopExited) -> Finding:
    """`loop-error` for a loop that exits instead of returning: its run cannot be judged."""
    text = f"sys.exit({o.code})"
    return loop_error(Observed(o.rung, Severity.ERROR,
        f"The loop called {text} in the {o.precision} run: it must return "
        "to its caller (ampdoctor runs it several times in one process), so its "
        "run could not be judged.",
        evidence={"error": text, "measured": text, "expected": None,
                  "precision": o.precision}, location=o.location))


@dataclass(frozen=True)
class LoopRaised:
    """The loop raised: the exception (quoted), the user's frames it went through (outermost,
    the loop's own line, first), the torch clipping function given None as its threshold when
    that is what raised, and the full traceback."""

    rung: str
    precision: str
    error: str
    frames: tuple[Location, ...] = ()
    clip_given_none: str | None = None
    location: Location | None = None
    traceback: str | None = None


def loop_raised(o: LoopRaised) -> Finding:
    """`loop-error` for a loop that raised: nothing after it can be judged (exit 3)."""
    # measured: the exception (`LOOP_ERROR.measured`); expected: none, the loop returns
    evidence: Evidence = {"error": o.error, "measured": o.error, "expected": None,
                          "precision": o.precision}
    text = o.error
    if o.clip_given_none is not None:
        # the loop clips at run.max_grad_norm, which is None: say why, not only that it is
        evidence["max_grad_norm"] = None
        text = (f"{text}. torch's {o.clip_given_none}() was given None as its threshold: "
                "run.max_grad_norm is null because the spec has no max_grad_norm. Set "
                "max_grad_norm in the spec (for example `max_grad_norm: 1.0`), or clip only "
                "when run.max_grad_norm is not None")
    called_from = ""
    if len(o.frames) > 1:
        # innermost user frame is the location; the loop's own line is where it was called
        outer = o.frames[0]
        evidence["loop_line"] = _at(outer)
        evidence["user_frames"] = [f"{_at(f)} in {f.function}" for f in o.frames]
        called_from = (f" (in {o.frames[-1].function}(), called from the loop at "
                       f"{os.path.basename(outer.file)}:{outer.line})")
    return loop_error(Observed(o.rung, Severity.ERROR,
        f"The loop raised in the {o.precision} run: {text}{called_from}",
        evidence=evidence, location=o.location, traceback=o.traceback))


@dataclass(frozen=True)
class RungTimedOut:
    """A rung stopped at its timeout_s: where the loop was, and the last call the probe saw
    (its kind, line, the backwards so far and its micro-batch)."""

    rung: str
    seconds: float
    loop_site: Location | None = None
    last_call: str | None = None
    last_site: Location | None = None
    backwards: int = 0
    microbatch: Any = None


def rung_timed_out(o: RungTimedOut) -> Finding:
    """`loop-error` for a rung that did not finish within timeout_s (a loop that never ends,
    or a very slow one)."""
    site = o.loop_site
    where = f" The loop was at {_at(site)} ({site.function})." if site else ""
    seen = ""
    evidence: Evidence = {"timeout_s": o.seconds, "measured": o.seconds, "expected": None}
    if o.last_call is not None:
        at = f" at {_at(o.last_site)}" if o.last_site else ""
        seen = (f" The last call ampdoctor saw was {o.last_call}{at}, after {o.backwards} "
                f"backward pass(es).")
        evidence.update({"last_event": o.last_call, "backwards": o.backwards,
                         "microbatch": o.microbatch})
    return loop_error(Observed(o.rung, Severity.ERROR,
        f"The {o.rung} rung did not finish within timeout_s = {o.seconds:g} s and was "
        f"stopped.{where}{seen} A loop that never ends (a `while True` without "
        "its exit, an iterator that never runs out) or a very slow one: raise "
        "`timeout_s` in the spec if it is only slow.",
        evidence=evidence, location=site))


@dataclass(frozen=True)
class IgnoresMicroBatches:
    """The fp32 loop took none of the micro-batches it was handed, yet ran backwards and
    optimizer steps (it builds its own data)."""

    rung: str
    micro_batches: int
    backwards: int
    optimizer_steps: int
    location: Location | None = None


def ignores_micro_batches(o: IgnoresMicroBatches) -> Finding:
    """`loop-error` for a loop whose updates cannot be compared with any reference."""
    return loop_error(Observed(o.rung, Severity.ERROR,
        f"The fp32 loop never took a micro-batch from `micro_batches` (0 of {o.micro_batches}) "
        f"but ran {o.backwards} backward pass(es) and {o.optimizer_steps} optimizer step(s): "
        "it builds its own data, so nothing it does can be compared with the reference. "
        "Iterate the `micro_batches` argument ampdoctor hands to train_loop.",
        evidence={"measured": 0, "expected": o.micro_batches, "backwards": o.backwards,
                  "optimizer_steps": o.optimizer_steps},
        location=o.location))


@dataclass(frozen=True)
class RankRaised:
    """One rank of the DDP run raised first (the others were stopped)."""

    rung: str
    rank: int
    world_size: int
    error: str
    location: Location | None = None


def rank_raised(o: RankRaised) -> Finding:
    """`loop-error` for a rank that raised under DDP."""
    return loop_error(Observed(o.rung, Severity.ERROR,
        f"The loop raised on rank {o.rank} of {o.world_size} in the DDP run: "
        f"{o.error}. Every other rank was stopped.",
        evidence={"error": o.error, "measured": o.error, "expected": None, "rank": o.rank,
                  "world_size": o.world_size},
        location=o.location))


@dataclass(frozen=True)
class RanksHung:
    """Ranks of the DDP run stopped at ddp.timeout_s: those still in the user's loop (the
    first one's line), those that had left it and waited in ampdoctor's gather, and the ranks
    that did not finish."""

    rung: str
    world_size: int
    timeout_s: float
    in_loop: tuple[int, ...]
    waiting: tuple[int, ...]
    missing: tuple[int, ...]
    location: Location | None = None


def ranks_hung(o: RanksHung) -> Finding:
    """`loop-error` for a DDP run that hung (a collective its peers never join, or a loop that
    never ends)."""
    site = o.location
    ranks = ", ".join(map(str, o.in_loop or o.missing))
    text = (f"Rank(s) {ranks} of {o.world_size} did not finish the loop within ddp.timeout_s = "
            f"{o.timeout_s:g} s and were stopped"
            + (f", waiting at {_at(site)} ({site.function})" if site else "")
            + ": a hang (a collective its peers never join -- ranks taking different numbers "
            "of steps or syncs --, or a loop that never ends)")
    if o.in_loop and o.waiting:
        text += (f"; rank(s) {', '.join(map(str, o.waiting))} had left the loop and waited for "
                 "the others")
    return loop_error(Observed(o.rung, Severity.ERROR, text + ".",
        evidence={"measured": len(o.in_loop or o.missing), "expected": 0,
                  "ranks_in_the_loop": list(o.in_loop), "ranks_past_the_loop": list(o.waiting),
                  "timeout_s": o.timeout_s, "world_size": o.world_size},
        location=site))


@dataclass(frozen=True)
class ProcessKilled:
    """The watchdog killed the process running a rung at its hard bound: the loop did not stop
    when ampdoctor stopped it. Where the user's code was (from its dumped stacks) and the last
    progress it reported."""

    rung: str
    bound: str                  # the spec key of the bound (`timeout_s`, `ddp.timeout_s`)
    timeout: float
    elapsed: float
    location: Location | None = None     # the user's frame (file, line)
    function: str | None = None
    progressed: bool = False    # it reported progress at all
    last_precision: str | None = None
    last_step: int | None = None
    steps: int | None = None    # the optimizer steps of that run, where it said


def process_killed(o: ProcessKilled) -> Finding:
    """`loop-error` of a loop that did not stop: an error."""
    where = f" It was at {_at(o.location)} ({o.function})." if o.location else ""
    seen = ""
    if o.last_precision:
        steps = f"/{o.steps}" if o.steps else ""
        seen = (f" Its last progress was the {o.last_precision} run at optimizer step "
                f"{o.last_step or 0}{steps}.")
    # the bound is keyed by its own name: `timeout_s`, `ddp.timeout_s` or ampdoctor's start bound
    evidence = cast("Evidence", {o.bound: o.timeout, "measured": round(o.elapsed, 1),
                                 "expected": None, "killed_after_s": round(o.elapsed, 1)})
    if o.progressed:
        evidence.update({"last_precision": o.last_precision, "last_step": o.last_step})
    return loop_error(Observed(o.rung, Severity.ERROR,
        f"The {o.rung} rung did not finish within {o.bound} = {o.timeout:g} s, and the "
        f"loop did not stop when ampdoctor stopped it (a bare `except:` that swallows "
        f"the stop, a SIGALRM handler or `signal.alarm` of its own, or a call that "
        f"never returns), so the process running it was killed after {o.elapsed:.0f} s."
        f"{where}{seen} A loop that never ends or a very slow one: raise `{o.bound}` in "
        f"the spec if it is only slow.",
        evidence=evidence, location=o.location, title="The loop did not stop",
        fix="Let the loop end: no bare `except:` around the training step, no signal "
            "handlers of its own during the triage; raise the timeout if it is only slow."))


@dataclass(frozen=True)
class ProcessDied:
    """The process running the loop ended without sending its record (a signal, a crash in
    native code, an exit the loop forced)."""

    rung: str                   # the phase it was in (a rung, or starting/loading/finishing)
    exit_status: int | None
    signal_name: str | None = None   # the signal that killed it, where one did

    @property
    def how(self) -> str:
        return (f"was killed by {self.signal_name}" if self.signal_name
                else f"exited with status {self.exit_status}")

    @property
    def message(self) -> str:
        """What happened, also the record's `error` where it died outside a rung."""
        where = {"starting": "while starting (before any user code ran)",
                 "loading": "while loading the spec's code",
                 "finishing": "after the last rung"}.get(self.rung,
                                                         f"during the {self.rung} rung")
        return (f"The process running the loop {self.how} {where}, before ampdoctor could write "
                "its record (a crash in native code, running out of memory, or the loop "
                "killing its own process); the record holds the rungs that finished.")


def process_died(o: ProcessDied) -> Finding:
    """`loop-error` of a process that died during a rung: an error."""
    return loop_error(Observed(o.rung, Severity.ERROR, o.message,
        evidence={"measured": None, "expected": None, "exit_status": o.exit_status},
        title="The process running the loop died",
        fix="Run the loop alone to see the crash (a segfault in an extension, the "
            "out-of-memory killer in the system log)."))
