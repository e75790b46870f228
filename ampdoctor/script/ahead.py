"""Runs of the script started before the ladder asks for them, two at a time on a CPU.

A diagnose makes about ten runs of the script, one after the other: each pays the script's own
set-up (its model built, its data loaded, its first step's lazy work) and most of them only wait
on the run before for the fp32 run's initial weights. Once the fp32 run is back, the runs that
need nothing more -- the repeat of the fp32 run, the bf16 and fp16 runs -- are started one at a
time beside the run the ladder is waiting for (`Ahead`), and read when the ladder gets there.
Each run is still a process of its own, forked from the same server: what it computes does not
depend on what runs beside it.

Runs overlap only where that cannot change them (`overlap_refused` says why not): the script
trains on the CPU (two runs on one GPU could run out of its memory), two of them fit in the
memory available, the machine has two cores for them, and the script forms no process group
(a port of its own) and builds no DeepSpeed engine. A run started ahead that raised is run again
alone before its error is believed; the ladder stopping early stops what is still running
(`spawn.stop_all`). `AMPDOCTOR_SCRIPT_PARALLEL=0` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .child import Job, Outcome
from .command import Command
from .scratch import Scratch
from .spawn import Run, RunDied, RunTimedOut, read_output

#: the environment variable that turns overlapping runs off ("0")
ENV = "AMPDOCTOR_SCRIPT_PARALLEL"


@dataclass
class Started:
    """A run the ladder has not read yet: its job, its name in the record, and the process
    (None until a slot frees) with where its output goes."""

    job: Job
    what: str
    run: Run | None = None
    log: str | None = None


class Ahead:
    """The runs started ahead of the ladder (module docstring): at most one at a time beside
    the one the ladder waits for."""

    def __init__(self, start: Callable[[Job, str], tuple[Run, str | None]]) -> None:
        self._start = start
        self.queue: dict[str, Started] = {}
        self.enabled = False
        self._follow: weakref.WeakMethod[Callable[[], None]] | None = None

    def plan(self, runs: list[tuple[str, Job, str]], first: bool = False) -> None:
        """Queue `runs` (name, job, what), started in this order as slots free; `first`:
        before the runs already waiting."""
        if not self.enabled:
            return
        added = {name: Started(job, what) for name, job, what in runs if name not in self.queue}
        self.queue = {**added, **self.queue} if first else {**self.queue, **added}
        self.fill()

    def follow_with(self, method: Callable[[], None]) -> None:
        """Call `method` when a run started ahead has ended, before the next one starts: what
        follows from it (its reference) may be queued then (`ScriptSession.follow_ups`). Held
        weakly: the runs must not keep the session, its traces and weights, alive."""
        self._follow = weakref.WeakMethod(method)

    def ended(self) -> None:
        """A run started ahead has ended: what follows from it queued, the next started."""
        follow = self._follow() if self._follow is not None else None
        if follow is not None and self.enabled:
            follow()
        self.fill()

    def finished(self, name: str) -> Run | None:
        """The queued run `name` if it has ended (read, not yet taken by the ladder)."""
        started = self.queue.get(name)
        if started is None or started.run is None or not started.run.collect():
            return None
        return started.run

    def drop(self, name: str) -> None:
        """A queued run the ladder will not ask for as it was queued: stopped, forgotten."""
        started = self.queue.pop(name, None)
        if started is not None and started.run is not None:
            started.run.stop()

    def take(self, name: str | None) -> Started | None:
        """The queued run `name`, started or not, now the ladder's to read."""
        return self.queue.pop(name, None) if name is not None else None

    def in_flight(self) -> list[Run]:
        return [s.run for s in self.queue.values() if s.run is not None and not s.run.ended]

    def fill(self) -> None:
        """Start the next queued run when none started ahead is still running."""
        if not self.enabled or self.in_flight():
            return
        waiting = next((s for s in self.queue.values() if s.run is None), None)
        if waiting is not None:
            try:
                waiting.run, waiting.log = self._start(waiting.job, waiting.what)
            except Exception:  # noqa: BLE001 - the ladder starts it itself (and says why)
                self.give_up()

    def give_up(self) -> None:
        """No more runs ahead: those started are stopped, the queue emptied."""
        self.enabled = False
        for started in self.queue.values():
            if started.run is not None:
                started.run.stop()
        self.queue.clear()


class Runs:
    """Every run of one diagnose's script: started now or ahead of the ladder (`Ahead`), each
    in a folder of the scratch, its output captured when the command asks for it."""

    def __init__(self, command: Command, scratch: Scratch) -> None:
        self.command, self.scratch = command, scratch
        #: each run's captured output, in the order the ladder read the runs
        self.outputs: list[dict[str, Any]] = []
        self.ahead = Ahead(self._start)
        #: whether a run failed beside another (none overlaps after it), and those of them
        #: that did not fail alone
        self.failed_overlapping = False
        self.failed_beside: list[str] = []
        self._logs = 0

    def allow_overlap(self, refused: str | None) -> bool:
        """Runs go two at a time from now where nothing `refused` it, no run failed beside
        another, and the runs' output is captured (with `--verbose` it would interleave)."""
        self.ahead.enabled = (refused is None and not self.failed_overlapping
                              and self.command.output_dir is not None)
        return self.ahead.enabled

    def run(self, job: Job, what: str, ahead: str | None = None) -> Outcome:
        """One run of the script: `job`, or the run queued ahead under the name `ahead`
        (the same job, perhaps done already; its time bound counts from now). A run that
        overlapped another and failed (raised, died, or ran past its bound) is run again alone
        before its failure is believed, and no run overlaps after it."""
        from ..core import progress
        started = self.ahead.take(ahead)
        if started is not None:
            job, what = started.job, started.what
        progress.run_started(what, None)
        if started is None or started.run is None:
            running, log = self._start(job, what)
            self.ahead.fill()
            overlapped = bool(self.ahead.in_flight())
        else:
            running, log, overlapped = started.run, started.log, True
            running.restart_clock()
            self.ahead.fill()
        if not overlapped:
            return self._finish(running, log, job, what, beside=False)
        try:
            outcome: Outcome | None = self._finish(running, log, job, what, beside=True,
                                                   keep=False)
        except (RunDied, RunTimedOut):
            outcome = None
        if outcome is not None and outcome.error is None:
            self._keep_output(log, job, what, outcome, beside=True)
            return outcome
        # (another process beside it, its memory or a port of the script's own, may be why):
        # believed only from a run alone, and no run overlaps after it
        self._drop_output(log)
        self.ahead.give_up()
        self.failed_overlapping = True
        progress.run_started(what, None)
        job.scratch = None
        running, log = self._start(job, what)
        alone = self._finish(running, log, job, what, beside=False)
        if alone.error is None:
            self.failed_beside.append(what)
        return alone

    def _start(self, job: Job, what: str) -> tuple[Run, str | None]:
        """Start one child run (its folder in the scratch, its output captured when the
        command asks for it)."""
        if job.scratch is None:
            job.scratch = self.scratch.folder()
        log = None
        if self.command.output_dir is not None:
            self._logs += 1
            log = os.path.join(self.command.output_dir, f"{self._logs:03d}.log")
        try:
            return Run(job, self.command.timeout_s, what, log), log
        except BaseException:
            shutil.rmtree(job.scratch, ignore_errors=True)
            raise

    def _finish(self, running: Run, log: str | None, job: Job, what: str, beside: bool,
                keep: bool = True) -> Outcome:
        """The outcome of a started run; its folder removed, its output kept (`keep`) in
        `outputs` in the order the ladder read the runs."""
        outcome = None
        try:
            outcome = running.wait(self.ahead.in_flight, self.ahead.ended)
            return outcome
        finally:   # (a run stopped at its time bound leaves its folder behind)
            shutil.rmtree(job.scratch or "", ignore_errors=True)
            if keep:
                self._keep_output(log, job, what, outcome, beside)

    def _keep_output(self, log: str | None, job: Job, what: str, outcome: Outcome | None,
                     beside: bool) -> None:
        if log is None:
            return
        self.outputs.append({"run": what, "args": list(job.args),
                             "optimizer_steps": None if outcome is None
                             else len(outcome.steps),
                             "beside": beside, "text": read_output(log)})
        self._drop_output(log)

    @staticmethod
    def _drop_output(log: str | None) -> None:
        if log is not None:
            with contextlib.suppress(OSError):
                os.unlink(log)


def reference_of(precision: str) -> str:
    """The name under which the reference of a precision's run is queued ahead."""
    return f"reference of the {precision} run"


def same_weights(a: Job, b: Job) -> bool:
    """Whether two reference jobs are teacher-forced to the same weights (the same objects)."""
    return (a.steps == b.steps and a.teacher is not None and b.teacher is not None
            and len(a.teacher) == len(b.teacher)
            and all(x is y for x, y in zip(a.teacher, b.teacher, strict=True)))


def early_overlap_refused(script: str) -> str | None:
    """Why the first two runs (the reference's first window and the fp32 run) must not run at
    once, before either has said where it trains (None: they may): a GPU on the machine (two
    runs of the script could run out of its memory), one core, a script that may form a process
    group or build a DeepSpeed engine (read from its text), turned off."""
    switched_off = _switched_off()
    if switched_off is not None:
        return switched_off
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    if "init_process_group" in text or "deepspeed" in text.lower():
        return "the script may form a process group"
    import torch
    if torch.backends.cuda.is_built() and any(
            os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")):
        return "a GPU on this machine"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "a GPU on this machine"
    if _available_memory() is None:
        return "the free memory is unknown"
    return None


def overlap_refused(outcome: Outcome, reference: Outcome | None = None) -> str | None:
    """Why two runs of this script must not run at once (None: they may), read off its fp32
    run: where it trained, what it started, how much memory it took (and the reference's
    first run: the reference holds K micro-batches in one)."""
    switched_off = _switched_off()
    if switched_off is not None:
        return switched_off
    if not outcome.device.startswith("cpu"):
        return f"the script trains on {outcome.device}"
    if outcome.group_of_one or _builds_engine(outcome):
        return "the script forms a process group"
    available = _available_memory()
    peak = max(outcome.peak_rss, reference.peak_rss if reference is not None else 0)
    if not outcome.peak_rss or available is None or 2 * peak > available:
        return "not enough free memory for two runs"
    return None


def _switched_off() -> str | None:
    """What refuses every overlap, whatever the script: the variable, one core."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no"):
        return f"{ENV}=0"
    if _cores() < 2:
        return "one CPU core"
    return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _builds_engine(outcome: Outcome) -> bool:
    from ..probe.events import EngineBuilt
    return any(isinstance(e, EngineBuilt) for e in outcome.events)


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
