"""The CLI's watchdog: a diagnose runs in a child process (`worker.py`) that this process
watches, so no loop can hang the command, outlive its report, or take over its terminal.

- Each phase (loading the spec's code, each rung, the record after the last rung) has a hard
  bound: the spec's `timeout_s` (a ddp-sync rung: `ddp.timeout_s`) plus a grace period. The
  child stops a rung at `timeout_s` on its own (SIGALRM, a finding saying where the loop was);
  a loop that ignores or replaces SIGALRM, swallows the stop with a bare `except:`, or never
  returns from C code is killed here at the hard bound, after its Python stacks were dumped
  (SIGUSR2, faulthandler), and the record says the rung's loop did not stop (exit 3).
- The child's stdout and stderr (the loop's prints, `os.write(1, ...)`) are shown on this
  process's stderr: stdout carries only ampdoctor's report (with `--json`, one JSON document).
- A child that dies (a segfault, `os.kill(os.getpid(), 9)`) or ends without a record gives a
  record saying so, with the rungs that finished.
- The child leaves with `os._exit` once its record is sent: a non-daemon thread the loop
  started cannot keep the command alive.

Torch is never imported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import processes
from ..core.errors import (
    AmpdoctorError,
    InputError,
    LaunchError,
    SpecError,
    UsageError,
    UserCodeError,
)
from ..core.launch import take
from .records import died_record, hung_record

if TYPE_CHECKING:   # (pydantic's import waits until the worker has started)
    from ..record.model import RecordModel, RungModel

#: Extra seconds past `timeout_s` before a phase that did not end is killed: the child's own
#: stop (at `timeout_s`) needs time to unwind the loop and write its finding. At most this,
#: at least MIN_GRACE_S, else `timeout_s` itself.
GRACE_S = 10.0
MIN_GRACE_S = 3.0
#: ampdoctor's own start in the child (the interpreter, torch's import), before any user code.
STARTUP_S = 300.0
#: A script's run is stopped by the worker at its bound (AMPDOCTOR_SCRIPT_TIMEOUT_S); past it
#: by this much (its process's start included: a fork server importing torch), it is killed here.
SCRIPT_GRACE_S = 60.0
#: A ddp-sync rung bounds its own rank processes at `ddp.timeout_s` and then stops them.
DDP_GRACE_S = 30.0
#: How long the child is given to write its stacks after SIGUSR2.
DUMP_WAIT_S = 1.5

_ERRORS = {cls.__name__: cls for cls in (SpecError, InputError, UsageError, UserCodeError,
                                         LaunchError)}


class ChildCrashed(Exception):
    """A bug in ampdoctor inside the child (its traceback is `remote_traceback`)."""

    def __init__(self, message: str, remote_traceback: str | None) -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback


def rebuild_error(fields: dict[str, Any]) -> AmpdoctorError:
    """The child's AmpdoctorError as the same class here (message, exit code, location), with
    its traceback text kept for `--debug`."""
    cls = _ERRORS.get(str(fields.get("type")), UserCodeError)
    exc = cls(str(fields.get("message") or ""))
    if fields.get("exit_code") in (2, 3) and exc.exit_code != fields["exit_code"]:
        exc.exit_code = int(fields["exit_code"])
    exc.remote_traceback = fields.get("traceback")
    return exc


@dataclass
class Outcome:
    """What the child gave: the record (or None), the error that stopped it, the rung results
    seen so far (as the record holds them)."""

    record: RecordModel | None = None
    error: AmpdoctorError | None = None
    done: list[RungModel] = field(default_factory=list)


class Watch:
    """One child run: reading its three pipes, enforcing each phase's bound."""

    def __init__(self, spec: Any, wire: str, on_event: Callable[[dict[str, Any]], None],
                 on_output: Callable[[str], None]) -> None:
        self.spec = spec
        self.on_event = on_event
        self.on_output = on_output
        self.outcome = Outcome()
        self.phase = "starting"     # "starting", "loading", a rung id, or "finishing"
        self.phase_started = time.monotonic()
        self.last_progress: dict[str, Any] | None = None
        self.main_thread: int | None = None
        self.result_seen = False
        #: a script's runs are each bounded (by the worker too): the clock restarts per run
        self.per_run = bool(getattr(spec, "script", None))
        # the worker: the one the console script started before it parsed its options (a
        # script's diagnose, its fork server warming up), else one started now
        launch = take()
        self.temp, self.dump_path = launch.temp, launch.dump_path
        self.token, self.guardian, self.proc = launch.token, launch.guardian, launch.proc
        read_fd = launch.read_fd
        launch.send_job(wire)
        self.buffers: dict[int, bytes] = {}
        self.sel = selectors.DefaultSelector()
        self.channel = os.fdopen(read_fd, "rb", buffering=0)
        for stream in (self.channel, self.proc.stdout, self.proc.stderr):
            assert stream is not None
            os.set_blocking(stream.fileno(), False)
            self.sel.register(stream, selectors.EVENT_READ)
            self.buffers[stream.fileno()] = b""

    # ------------------------------------------------------------------------ reading
    def limit(self) -> tuple[float, str]:
        """The bound the phase in progress was given, before the grace, and what gives it."""
        if self.phase == "starting":
            return STARTUP_S, "ampdoctor's start bound"
        if self.phase == "ddp-sync" and self.spec.ddp:
            return float(self.spec.ddp.timeout_s), "ddp.timeout_s"
        if self.per_run:
            return float(self.spec.timeout_s), "the bound of one run of the script " \
                "(AMPDOCTOR_SCRIPT_TIMEOUT_S)"
        return float(self.spec.timeout_s), "timeout_s"

    def _bound(self) -> float:
        if self.phase == "starting":
            return STARTUP_S
        if self.phase == "ddp-sync" and getattr(self.spec, "ddp", None) is not None:
            return float(self.spec.ddp.timeout_s) + DDP_GRACE_S
        timeout = float(self.spec.timeout_s)
        if self.per_run:
            # the worker stops a script's run at its bound itself, once the run's process has
            # started (the first start imports torch): this is the backstop past both
            return timeout + SCRIPT_GRACE_S
        return timeout + max(MIN_GRACE_S, min(GRACE_S, timeout))

    def _pump(self, wait: float) -> bool:
        """Read what is there (waiting up to `wait` s); False once every pipe is closed."""
        if not self.sel.get_map():
            time.sleep(wait)
            return False
        for key, _ in self.sel.select(timeout=wait):
            stream = key.fileobj
            fd = key.fd
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.sel.unregister(stream)
                self._flush(fd, final=True)
                continue
            self.buffers[fd] += chunk
            self._flush(fd)
        return bool(self.sel.get_map())

    def _flush(self, fd: int, final: bool = False) -> None:
        data = self.buffers[fd]
        if fd == self.channel.fileno():
            *lines, rest = data.split(b"\n")
            self.buffers[fd] = b"" if final else rest
            for line in lines + ([rest] if final and rest else []):
                if line.strip():
                    self._event(line)
            return
        self.buffers[fd] = b""
        if data:
            self.on_output(data.decode("utf-8", errors="replace"))

    def _event(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return                       # not ours: a stray write on the channel
        kind = event.pop("event", None)
        now = time.monotonic()
        if kind == "hello":
            self.main_thread = event.get("main_thread")
            self.phase, self.phase_started = "loading", now
        elif kind == "rung":
            self.phase, self.phase_started, self.last_progress = event.get("id"), now, None
        elif kind == "progress":
            self.last_progress = event
            if self.per_run and not event.get("step") and self.phase != "starting":
                # a run of a script starts: each run is bounded on its own (timeout_s)
                self.phase_started = now
        elif kind == "done":
            if event.get("rung"):
                from ..record.model import RungModel
                self.outcome.done.append(RungModel.model_validate(event["rung"]))
            self.phase, self.phase_started = "finishing", now
        elif kind == "result":
            self.result_seen = True
            wired = event.get("record")
            from ..record.model import RecordModel
            self.outcome.record = (RecordModel.model_validate(wired) if wired is not None
                                   else None)
            if event.get("error"):
                self.outcome.error = rebuild_error(event["error"])
        elif kind == "internal":
            self.result_seen = True
            raise ChildCrashed(f"{event.get('type')}: {event.get('message')}",
                               event.get("traceback"))
        self.on_event({"event": kind, **event})

    # ------------------------------------------------------------------------ stopping
    def kill(self) -> None:
        """Kill the worker's group and the worker, left unreaped (`close` reaps it)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()
        self._exited(wait_s=10)

    def _exited(self, wait_s: float = 0.0) -> bool:
        """Whether the worker has exited, waiting up to `wait_s`; it is left unreaped, so that
        its pid, the id of its session, names nothing else until `_reap`."""
        deadline = time.monotonic() + wait_s
        while self.proc.returncode is None:
            try:
                if os.waitid(os.P_PID, self.proc.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(processes.POLL_S)
        return True

    def _reap(self) -> None:
        """The worker has exited: end what is left of its session (its id still the worker's:
        the worker is not reaped yet), then reap it."""
        if self.proc.returncode is None:
            processes.end(self.token, sessions=(self.proc.pid,))
        self.proc.wait()

    def stacks(self) -> str:
        """Ask the child for its Python stacks (SIGUSR2) and read what it wrote."""
        try:
            os.kill(self.proc.pid, signal.SIGUSR2)
        except (ProcessLookupError, PermissionError):
            return ""
        deadline = time.monotonic() + DUMP_WAIT_S
        size = -1
        while time.monotonic() < deadline:
            self._pump(0.1)
            current = os.path.getsize(self.dump_path)
            if current and current == size:
                break
            size = current
        try:
            return Path(self.dump_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Every process of the run ended (the worker, anything it started: `_reap` swept
        them, here or when the run ended; the guardian sweeps by the token once more), the
        pipes closed."""
        if self.proc.returncode is None:
            if not self._exited():
                self.kill()
            self._reap()
        self.guardian.close()
        for stream in (self.channel, self.proc.stdout, self.proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self.sel.close()
        shutil.rmtree(self.temp, ignore_errors=True)

    # ------------------------------------------------------------------------ the run
    def run(self) -> Outcome:
        while True:
            open_pipes = self._pump(0.2)
            if self._exited():
                # gone: read what is left, briefly (a grandchild may hold a pipe open)
                end = time.monotonic() + 2.0
                while self._pump(0.05) and time.monotonic() < end:
                    pass
                self._reap()
                break
            if not open_pipes and self.result_seen:
                self._exited(wait_s=float("inf"))
                self._reap()
                break
            elapsed = time.monotonic() - self.phase_started
            if elapsed > self._bound():
                stacks = self.stacks()
                self.kill()
                self.outcome.record = hung_record(self, elapsed, stacks)
                self.outcome.error = None
                return self.outcome
        if not self.result_seen:
            self.outcome.record = died_record(self)
        return self.outcome


def run(spec: Any, wire: str, on_event: Callable[[dict[str, Any]], None],
        on_output: Callable[[str], None]) -> Outcome:
    """Run the diagnose of `spec` (sent as `wire`, `spec.to_wire`) in a child process.

    Raises ChildCrashed for a bug in ampdoctor inside the child; KeyboardInterrupt (and the
    CLI's SIGTERM/SIGHUP interrupt) kill the child and propagate, with `.outcome` set on the
    exception so the caller can record the rungs that finished."""
    watch = Watch(spec, wire, on_event, on_output)
    try:
        return watch.run()
    except BaseException as exc:
        watch.kill()
        exc.outcome = watch.outcome   # type: ignore[attr-defined]  # any exception carries it
        raise
    finally:
        watch.close()
