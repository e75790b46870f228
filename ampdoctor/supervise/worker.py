"""The child process a CLI diagnose runs in (`supervise/__init__.py` is the parent).

The user's loop runs here, never in the process that owns the terminal: whatever it does to
process-wide state (threads it never joins, signal handlers, `sys.stdout` closed, `os.chdir`,
framework singletons), it ends with this process. The parent sends the job on stdin; this
process reports on the event channel (a pipe the parent passed), one JSON message per line:

    {"event": "hello", "pid": ..., "main_thread": ...}     once, before anything is imported
    {"event": "rung", "id": ...}                          a rung starts
    {"event": "progress", ...}                            an optimizer step of a run
    {"event": "done", "rung": {...}}                      a rung's result (as in the record)
    {"event": "result", "record": {...}, "error": {...}}  the run record; `error` when the
                                                          run stopped on an ampdoctor error
    {"event": "internal", "type", "message", "traceback"} a bug in ampdoctor itself

then leaves with `os._exit`, so a thread the loop left running cannot keep it alive. stdout and
stderr (the loop's prints, fd 1 and fd 2) are pipes the parent shows on its stderr; stdin is
/dev/null. On SIGUSR2 the Python stacks of every thread are written to the dump file (the
parent asks for it before it kills a run that did not stop).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, TextIO

from ..core import processes

if TYPE_CHECKING:
    from ..core.findings import RungResult

#: The real `os._exit`, taken before any user code could replace it.
_EXIT = os._exit


class Channel:
    """The event pipe: one compact JSON document per line (NaN and inf as null)."""

    def __init__(self, fd: int) -> None:
        self.stream: TextIO = os.fdopen(fd, "w", encoding="utf-8", closefd=True)
        self.lock = threading.Lock()

    def send(self, event: str, **fields: Any) -> None:
        from ..record.model import finite
        line = json.dumps({"event": event, **finite(fields)}, default=str, allow_nan=False,
                          separators=(",", ":"))
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()


def _error_fields(exc: BaseException) -> dict[str, Any]:
    from ..core.errors import format_traceback
    from ..core.safetext import exc_text
    fields: dict[str, Any] = {"type": type(exc).__name__,
                              "message": getattr(exc, "message", None) or exc_text(exc),
                              "exit_code": getattr(exc, "exit_code", 4)}
    cause = getattr(exc, "cause", None)
    fields["traceback"] = format_traceback(cause if cause is not None else exc)
    return fields


def main() -> None:
    processes.die_with_parent()   # (a killed CLI leaves no run)
    job = _read_job()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    processes.become_subreaper()  # what the loop's processes orphan stays ours to end
    channel = Channel(int(job["channel_fd"]))
    if job.get("dump_path"):
        import faulthandler
        import signal
        dump = open(job["dump_path"], "w", encoding="utf-8")  # noqa: SIM115 - lives as long as us
        faulthandler.register(signal.SIGUSR2, file=dump, all_threads=True)
    code = 0
    try:
        _warm_script_runs(job)   # (a no-op when the prestarted server is the job's)
        # ampdoctor's own start (torch's import can take seconds on a loaded machine) is done
        # before "hello": the parent's bound on loading the user's code starts there
        import torch  # noqa: F401

        from .. import api, ladder, runner, session  # noqa: F401
        channel.send("hello", pid=os.getpid(), main_thread=threading.main_thread().ident)
        _run(job, channel)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        import traceback

        from ..core.safetext import exc_text
        code = 4
        # a send that fails: the parent sees a run that ended without a result
        with contextlib.suppress(Exception):
            channel.send("internal", type=type(exc).__name__, message=exc_text(exc),
                         traceback="".join(traceback.format_exception(type(exc), exc,
                                                                      exc.__traceback__)))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - the loop may have closed them
            pass
        # nothing the run started outlives it (nor holds the parent's pipes open)
        with contextlib.suppress(Exception):
            processes.end_descendants()
        _EXIT(code)


def _read_job() -> dict[str, Any]:
    """The job from stdin (one JSON document). No job (the command ended first) or a parent
    that died before `die_with_parent`: nothing to run for."""
    line = sys.stdin.readline()
    message = json.loads(line) if line.strip() else {}
    if message.get("parent") not in (None, os.getppid()) or "spec" not in message:
        _EXIT(0)
    return message


def _warm_script_runs(job: dict[str, Any]) -> None:
    """A script's diagnose: the fork server its runs start from imports torch and the script's
    libraries while this process imports its own (two interpreters' start-up at once, not one
    after the other). The wire is read as plain JSON here (`source.from_wire` validates it
    later): pydantic's import would delay the server's start."""
    text = job.get("spec") or ""
    try:
        wire = json.loads(text) if text.lstrip().startswith("{") else None
    except ValueError:
        return
    script = wire.get("script_source") if isinstance(wire, dict) else None
    if isinstance(script, dict) and isinstance(script.get("script"), str):
        from ..script import spawn
        spawn.warm(script["script"], str(script.get("cwd") or os.getcwd()))


def _run(job: dict[str, Any], channel: Channel) -> None:
    """One diagnose of the job's run source (a spec, or a script: `source.ScriptSource`), its
    events and its record sent on the channel."""
    from ..api import diagnose
    from ..core.errors import AmpdoctorError
    from ..spec import from_wire
    from ..spec.source import from_wire as source_from_wire
    from ..spec.source import is_script_wire

    def done(result: RungResult) -> None:
        channel.send("done", rung=result.to_dict())

    def started(rung: str) -> None:
        channel.send("rung", id=rung)

    def progress(event: dict[str, Any]) -> None:
        channel.send("progress", **event)

    if is_script_wire(job["spec"]):
        from ..record import exit_code
        from ..script.diagnose import run_script
        record, exception = run_script(source_from_wire(job["spec"]), started, done, progress)
        record.exit_code = exit_code(record)
        channel.send("result", record=record.dump(),
                     error=_error_fields(exception) if exception is not None else None)
        return
    try:
        result = diagnose(from_wire(job["spec"]), save=False, on_start=started, on_done=done,
                          on_progress=progress)
    except AmpdoctorError as exc:     # a spec or launch error found once the run had begun
        channel.send("result", record=None, error=_error_fields(exc))
        return
    error = _error_fields(result.exception) if result.exception is not None else None
    channel.send("result", record=result.dump(), error=error)


if __name__ == "__main__":
    main()
