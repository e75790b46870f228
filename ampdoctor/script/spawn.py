"""Start one run of the script in a child process and wait for what it did, within a time bound.

Children are forked from a fork server (multiprocessing's `forkserver`) that imported torch and
ampdoctor once and never ran a parallel region: a fork of a process whose OpenMP threads ran
can hang in the child, and a fresh interpreter per run would import torch every time. Each run
starts from that clean state: nothing one run of the script does (its globals, its imports,
torch's settings) reaches the next. The child's stdout goes to stderr (`--json` keeps stdout
for the record); it dies with this process, and what it started (in its own process group)
dies with the run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from ..core import processes
from ..core.errors import UserCodeError
from . import prefork

try:
    import resource  # (imported in the fork server, not in each run: 8 ms a run)
except ImportError:   # pragma: no cover - not a Unix
    resource = None   # type: ignore[assignment]

_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() \
            else "spawn"
        _CONTEXT = multiprocessing.get_context(method)
        if method == "forkserver":
            # (safetensors: what the overlay patches in every run, imported once here;
            # torch.profiler._cupti_monitor: what the first `record_function` of a process
            # imports -- every optimizer step is one -- 25 ms in each run otherwise)
            _CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "safetensors",
                                            "torch.profiler._cupti_monitor",
                                            "ampdoctor.script.child",
                                            "ampdoctor.script.spawn",
                                            "ampdoctor.script.prefork"])
            from multiprocessing import resource_tracker
            with processes.quiet_fd2():     # it warns about what the killed runs left
                resource_tracker.ensure_running()
    return _CONTEXT


def warm_early() -> None:
    """The worker's first act, before it imports its own modules: the fork server of the
    script the console script is about to diagnose (`core.launch.WARM_ENV`), started now. The
    worker dies with the console script from here on; one whose console script is already gone
    starts nothing (it leaves once it reads no job)."""
    from ..core.launch import WARM_ENV
    raw = os.environ.pop(WARM_ENV, None)
    if not raw:
        return
    with contextlib.suppress(Exception):    # the job's own start says what is wrong
        import json
        message = json.loads(raw)
        processes.die_with_parent()
        if message.get("parent") == os.getppid():
            warm(str(message["script"]), str(message["cwd"]))


def warm(script: str, cwd: str) -> None:
    """Start the fork server for `script` now (it imports torch and the script's libraries
    while the caller imports its own: the worker calls this before it imports torch)."""
    ctx = _context()
    if ctx.get_start_method() == "forkserver":
        with _empty_main():
            prefork.serve(ctx, prefork.script_imports(script, cwd))


@contextlib.contextmanager
def _empty_main() -> Any:
    """The child must not import the parent's __main__ again (the CLI, a test runner, the
    user's own program): it is shown an empty one while the process starts."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _child_main(job: Any, conn: Any, log_path: str | None = None) -> None:
    """In the child: run the job, send back its outcome (pickled), leave without cleanup (a
    thread the script left running cannot keep the child alive). The script's stdout and
    stderr go to `log_path` when given (captured), else both to stderr."""
    code = 0
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)         # a group of its own: what the run starts ends with it
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_RDONLY)   # (the server may hold the CLI's pipe)
            os.dup2(devnull, 0)
            os.close(devnull)
        with contextlib.suppress(OSError):
            if log_path is not None:
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 2)
                os.close(fd)
            os.dup2(2, 1)            # the script's prints: stderr (or the log)
        sys.stdout = sys.stderr
        processes.die_with_parent()
        from . import child
        outcome = child.run(job)
        if resource is not None:         # the run's peak memory (`ahead.overlap_refused`)
            with contextlib.suppress(OSError):
                outcome.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        try:
            payload = dumps(("ok", outcome))
        except Exception as exc:  # noqa: BLE001 - an event the script made unpicklable
            payload = pickle.dumps(("internal", f"could not send the run back: {exc!r}"))
        with contextlib.suppress(Exception):
            sys.stderr.flush()       # the run's output is whole in its log once it reports
        conn.send_bytes(payload)
    except BaseException as exc:  # noqa: BLE001 - ampdoctor's own failure in the child
        import traceback
        with contextlib.suppress(Exception):
            conn.send_bytes(pickle.dumps(("internal", "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__)))))
        code = 1
    finally:
        with contextlib.suppress(Exception):
            conn.close()
        sys.stderr.flush()
        os._exit(code)


def dumps(value: Any) -> bytes:
    """`value` pickled, its plain CPU tensors as their raw bytes (torch's own pickling writes
    and reads each storage as a small archive: a run's outcome holds hundreds of tensors, and
    that was tens of milliseconds a run on each side)."""
    import io
    buffer = io.BytesIO()
    _TensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


class _TensorPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        import torch
        if (type(obj) is not torch.Tensor or obj.layout != torch.strided
                or obj.device.type != "cpu" or obj.grad_fn is not None or obj.is_complex()
                or obj.is_quantized or getattr(obj, "__dict__", None)):
            return NotImplemented   # torch's own pickling (a subclass, a view's graph, ...)
        flat = obj.detach().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return _tensor, (data, obj.dtype, tuple(obj.shape), obj.requires_grad)


def _tensor(data: bytes, dtype: Any, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """A tensor `dumps` wrote (in the process that reads the outcome)."""
    import torch
    if data:
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
    return tensor.requires_grad_(requires_grad)


#: runs that reported back and are leaving (a process with torch loaded takes ~10 ms to exit),
#: with whether they reported: ended at the next run's start or the diagnose's end, while the
#: worker reads the outcome
_ENDING: list[tuple[Any, bool]] = []


def finish_runs() -> None:
    """Every run that reported back has exited, and what it started has ended."""
    while _ENDING:
        process, reported = _ENDING.pop(0)
        if process.is_alive():
            process.join(5 if reported else 0)    # one that did not report is stopped now
        if process.is_alive():
            process.kill()
        process.join()
        # what the run started (DataLoader workers, daemonic children, `subprocess` helpers)
        # is in its group, even once orphaned; one that left it is the worker's to end. The
        # fork server reaped the child: the group's id may be a stranger's by now, so only
        # what carries this worker's run token is the run's
        processes.end(groups=(process.pid,), carrying=processes.own_token())


class RunDied(UserCodeError):
    """A run's process ended without reporting back (killed, `os._exit`, a native crash)."""


class RunTimedOut(UserCodeError):
    """A run did not reach its last step within its time bound (it was stopped)."""


class ChildFailed(Exception):
    """ampdoctor's own code failed in the child (not the script): a bug to report."""


def run_child(job: Any, timeout_s: float, what: str, log_path: str | None = None) -> Any:
    """Run `job` (a `child.Job`) in a child process; its `child.Outcome`. UserCodeError (exit 3)
    when it does not finish within `timeout_s` or the process died without a word (os._exit,
    a crash in native code). `log_path`: where the script's output goes (else stderr)."""
    return Run(job, timeout_s, what, log_path).wait()


class Run:
    """One run of the script, started in a child process (`wait` for its outcome). A diagnose
    may start a run before the ladder reads it (`ScriptSession.ahead`): its outcome is read as
    soon as it reports (`collect`), so that the process can leave."""

    def __init__(self, job: Any, timeout_s: float, what: str, log_path: str | None = None):
        finish_runs()
        warm(job.script, job.cwd)         # the script's libraries imported once
        ctx = _context()
        self.what, self.timeout_s = what, timeout_s
        self.receiver, sender = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_child_main, args=(job, sender, log_path))
        with _empty_main():
            self.process.start()
        sender.close()
        self.deadline = time.monotonic() + timeout_s
        self.payload: bytes | None = None
        self._result: tuple[bool, Any] | None = None
        self.ended = False
        _RUNNING.append(self)

    def collect(self, wait_s: float = 0.0) -> bool:
        """Read the outcome if the run has reported (or died) within `wait_s`; whether it
        has ended."""
        if self.ended:
            return True
        try:
            if self.receiver.poll(max(wait_s, 0.0)):
                try:
                    self.payload = self.receiver.recv_bytes()
                except EOFError:
                    self.payload = None
                self._end()
            elif not self.process.is_alive() and not self.receiver.poll(0):
                self._end()
        except OSError:
            self._end()
        return self.ended

    def _end(self) -> None:
        self.ended = True
        self.receiver.close()
        with contextlib.suppress(ValueError):
            _RUNNING.remove(self)
        _ENDING.append((self.process, self.payload is not None))
        if self.payload is None:
            finish_runs()

    def restart_clock(self) -> None:
        """The time bound counts from now (a run started ahead, now the one waited for)."""
        self.deadline = time.monotonic() + self.timeout_s

    def stop(self) -> None:
        """A run the diagnose no longer needs: ended now, with what it started."""
        if not self.ended:
            self.payload = None
            self._end()

    def wait(self, beside: Callable[[], list[Run]] | None = None,
             on_ended: Callable[[], None] | None = None) -> Any:
        """The outcome (see `run_child`; asked again, the same outcome or exception).
        `beside`: the other runs in flight, read as they report while this one is waited for,
        `on_ended` called after each."""
        while not self.ended:
            left = self.deadline - time.monotonic()
            if left <= 0 and not self.collect():   # (an outcome that came in time is read)
                self.stop()
                self._result = (False, RunTimedOut(
                    f"the {self.what} of the script did not reach its last step within "
                    f"{self.timeout_s:g} s: ampdoctor stopped it. Give it fewer steps (--steps) "
                    "or a smaller model or batch through its arguments."))
                break
            others = [r for r in (beside() if beside is not None else []) if not r.ended]
            if not others:
                self.collect(min(left, 0.5))
                continue
            from multiprocessing.connection import wait
            ready = wait([self.receiver, *(r.receiver for r in others)], min(left, 0.5))
            for run in others:
                if run.receiver in ready and run.collect() and on_ended is not None:
                    on_ended()
            self.collect()
        if self._result is None:
            self._result = self._read()
        ok, value = self._result
        if not ok:
            raise value
        return value

    def _read(self) -> tuple[bool, Any]:
        """(True, the outcome) or (False, the exception that says why there is none)."""
        if self.payload is None:
            code = self.process.exitcode
            how = (f"was killed by signal {-code}" if code is not None and code < 0
                   else f"exited with status {code}")
            return False, RunDied(
                f"the {self.what} of the script {how} before it reported back (os._exit, or a "
                "crash in native code): nothing of it can be judged.")
        status, value = pickle.loads(self.payload)
        self.payload = None
        return (True, value) if status == "ok" else (False, ChildFailed(value))


#: the runs started and not ended (`stop_all` ends them)
_RUNNING: list[Run] = []


def stop_all() -> None:
    """The end of a diagnose: a run started ahead that the ladder never read is stopped, and
    every run's processes end (`finish_runs`)."""
    for run in list(_RUNNING):
        run.stop()
    finish_runs()


#: The most of one run's output a record keeps: its first and last halves of this.
OUTPUT_LIMIT = 16 * 1024


def read_output(path: str) -> str:
    """A run's captured output, its middle cut when it is longer than OUTPUT_LIMIT."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    if len(data) > OUTPUT_LIMIT:
        half = OUTPUT_LIMIT // 2
        cut = len(data) - 2 * half
        data = data[:half] + f"\n[... {cut} bytes cut ...]\n".encode() + data[-half:]
    return data.decode("utf-8", errors="replace")
