"""The record of a run the watchdog stopped (`supervise`): a child killed at its hard bound
(where the user's code was, from its dumped stacks), or a child that died without sending its
record. Both keep the rungs that finished."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..record.model import ErrorModel, FindingModel, RecordModel


class Watch(Protocol):
    """What these records read of the run that was stopped (`supervise.Watch`, which imports
    this module: a protocol, not an import back)."""

    @property
    def spec(self) -> Any: ...
    @property
    def phase(self) -> str: ...
    @property
    def main_thread(self) -> int | None: ...
    @property
    def last_progress(self) -> dict[str, Any] | None: ...
    @property
    def outcome(self) -> Any: ...
    @property
    def proc(self) -> subprocess.Popen[bytes]: ...
    def limit(self) -> tuple[float, str]: ...

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
_THREAD = re.compile(r"^(?:Current thread|Thread) (?P<ident>0x[0-9a-fA-F]+)")


def _stacks_by_thread(text: str) -> dict[int, list[tuple[str, int, str]]]:
    """faulthandler's dump: thread ident -> frames, most recent first."""
    threads: dict[int, list[tuple[str, int, str]]] = {}
    current: list[tuple[str, int, str]] | None = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            current = threads.setdefault(int(head.group("ident"), 16), [])
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current.append((frame.group("file"), int(frame.group("line")),
                            frame.group("func").strip()))
    return threads


def _is_users(file: str, roots: list[Path]) -> bool:
    path = os.path.abspath(file)
    parts = Path(path).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    package = str(Path(__file__).resolve().parents[1])
    if path.startswith(package + os.sep):
        return False
    return any(path.startswith(str(root) + os.sep) for root in roots)


def user_frame(stacks: str, main_thread: int | None,
               roots: list[Path]) -> tuple[str, int, str] | None:
    """The innermost frame of the user's code in the dumped stacks: the main thread's first
    (where the loop runs), then any other thread's."""
    threads = _stacks_by_thread(stacks)
    order = sorted(threads, key=lambda ident: ident != main_thread)
    for ident in order:
        for file, line, func in threads[ident]:
            if _is_users(file, roots):
                return file, line, func
    return None


def _roots(spec: Any) -> list[Path]:
    roots = []
    for attr in ("root", "spec_dir"):
        value = getattr(spec, attr, None)
        if value is not None:
            roots.append(Path(os.path.abspath(value)))
    return roots


def _base_record(watch: Watch) -> RecordModel:
    """The record of the run so far: the rungs the child reported done."""
    from ..runner import new_record
    record = new_record(watch.spec, str(getattr(watch.spec, "device", "unknown")))
    record.rungs = list(watch.outcome.done)
    return record


def _close_ladder(record: RecordModel, rung: str, summary: str,
                  finding: FindingModel) -> None:
    """The stopped rung as a failure, the rungs after it not run."""
    from ..core.findings import RUNG_IDS
    from ..record.model import RungModel
    record.rungs.append(RungModel(id=rung, status="fail",
                                  seconds=finding.evidence.get("measured", 0.0),
                                  summary=summary))
    record.findings.append(finding)
    seen = {r.id for r in record.rungs}
    for rung_id in RUNG_IDS:
        if rung_id not in seen and rung_id in RUNG_IDS[RUNG_IDS.index(rung) + 1:]:
            record.rungs.append(RungModel(id=rung_id.value, status="not-run", seconds=0.0,
                                          summary="an earlier rung failed"))
    record.failed_rung = rung
    record.verdict = "error"


def _user_code_error(message: str, location: tuple[str, int] | None = None) -> ErrorModel:
    """The record's `error` of a child that hung or died outside a rung (exit 3)."""
    from ..record.model import ErrorModel, LocationModel
    error = ErrorModel(type="UserCodeError", message=message, exit_code=3)
    if location:
        error.location = LocationModel(file=location[0], line=location[1])
    return error


def hung_record(watch: Watch, elapsed: float, stacks: str) -> RecordModel:
    """The record of a run killed at its hard bound: the rungs that finished, the stopped one
    as a loop-error saying the loop did not stop, where it was, and the rest not run."""
    record = _base_record(watch)
    timeout, key = watch.limit()
    site = user_frame(stacks, watch.main_thread, _roots(watch.spec))
    progress = watch.last_progress or {}
    location = (site[0], site[1]) if site else None
    if watch.phase in ("starting", "loading", "finishing"):
        what = {"starting": "ampdoctor's start (the interpreter, importing torch)",
                "loading": "loading the spec's code (importing it, the data factory)",
                "finishing": "the end of the run"}[watch.phase]
        where = f" It was at {site[0]}:{site[1]} ({site[2]})." if site else ""
        message = (f"{what[0].upper()}{what[1:]} did not finish within {key} = {timeout:g} s and "
                   f"did not stop when asked, so the process running it was killed after "
                   f"{elapsed:.0f} s.{where}")
        record.error = _user_code_error(message, location)
        record.verdict = "error"
        return record
    from ..core.findings import Location
    from ..kinds.loop_error import ProcessKilled, process_killed
    from ..record.model import FindingModel
    finding = FindingModel.of(process_killed(ProcessKilled(
        watch.phase, key, timeout, elapsed, location=Location(*location) if location else None,
        function=site[2] if site else None, progressed=bool(progress),
        last_precision=progress.get("precision"), last_step=progress.get("step"),
        steps=progress.get("steps"))))
    _close_ladder(record, watch.phase, f"the loop did not stop; killed after {elapsed:.0f} s",
                  finding)
    return record


def died_record(watch: Watch) -> RecordModel:
    """The record of a child that ended without sending one (killed by a signal, a crash in
    native code, an exit the loop forced)."""
    from ..kinds.loop_error import ProcessDied, process_died
    from ..record.model import FindingModel
    record = _base_record(watch)
    code = watch.proc.returncode
    died = ProcessDied(watch.phase, code, signal.Signals(-code).name
                       if code is not None and code < 0
                       and -code in {s.value for s in signal.Signals} else None)
    if watch.phase in ("starting", "loading", "finishing"):
        record.error = _user_code_error(died.message)
        return record
    finding = FindingModel.of(process_died(died))
    _close_ladder(record, watch.phase, f"the process {died.how}", finding)
    return record
