"""Every process a run starts is ampdoctor's, and has ended when ampdoctor is done with the run.

A run's processes (the worker, the script's children and grandchildren, DataLoader workers,
multiprocessing's fork server and resource tracker, daemonic children, `subprocess` helpers)
are found three ways, on Linux through /proc:

- the run token: `AMPDOCTOR_RUN_TOKEN` in the environment of the worker (or of this process
  while an in-process diagnose runs) holds a fresh token; every descendant inherits it. Nested
  runs append theirs, `:`-separated, so an inner run ends only its own;
- a session or process group: the worker starts in a session of its own, one run of a script
  in a process group of its own; a descendant that cleared its environment is still in it
  unless it left it (setsid, setpgid);
- parenthood: the worker is a child subreaper (`become_subreaper`), so what its descendants
  orphan becomes its child, and its descendants are found from it.

`end` kills (SIGKILL) what it finds, again until nothing is left, never this process or one of
its ancestors. A session or group id, or a root pid, is a number the kernel gives again once the
last process holding it is gone: it is used only while it cannot have been given again (its
leader not yet reaped, `carrying` a token, or the same process: same start time as first seen),
so a sweep never reaches a stranger that was given a recycled number.

A SIGKILL to the CLI leaves no time to do it: `Guardian` is a small process of
ampdoctor's own (its own session, stdin a pipe from the CLI, stdout and stderr /dev/null so it
never holds the caller's pipes) that does it when that pipe closes, whatever closed it.

A SIGKILLed worker cannot remove its temporary folders either: ampdoctor's own temporary files
(a script's scratch folder, which may hold its checkpoints, its captured outputs, spilled
gradients, the stack dump) go in the run's folder (`temp_root`, named by `TEMP_ENV`), which the
CLI removes when it is done with the run and the guardian removes when the CLI died.

Standard library only (the guardian runs this file as a script, `python -I -S processes.py`);
without /proc, only process groups are killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

#: The environment variable that marks a run's processes.
TOKEN_ENV = "AMPDOCTOR_RUN_TOKEN"
#: The environment variable naming the run's temporary folder (set for the worker by the CLI).
#: Not TMPDIR: the script's own temporary files and multiprocessing's sockets keep theirs.
TEMP_ENV = "AMPDOCTOR_TEMP"
#: the prefix of the folder that holds a config copied for an inferred reference
#: (`script.infer_config`); a record's reference arguments naming it were inferred from a copy
REFERENCE_COPY_PREFIX = "ampdoctor-reference-"
#: How long `end` keeps killing what it finds (a process that forks while it is killed).
END_WAIT_S = 3.0
#: How long the caller waits for its guardian to leave once done with it.
GUARDIAN_WAIT_S = 2.0
#: How often a wait for processes to end looks again (each diagnose waits at its end: a
#: coarse step is paid in its wall time)
POLL_S = 0.005
_PROC = "/proc"


def new_token() -> str:
    return uuid.uuid4().hex


def temp_root() -> str | None:
    """The folder this run's ampdoctor-made temporary files go in (`tempfile`'s `dir=`), or
    None (the system's) outside a supervised run or when it is gone."""
    root = os.environ.get(TEMP_ENV)
    return root if root and os.path.isdir(root) else None


def with_token(env: dict[str, str], token: str) -> dict[str, str]:
    """`env` with `token` added to the run tokens it carries."""
    held = env.get(TOKEN_ENV, "")
    return dict(env, **{TOKEN_ENV: f"{held}:{token}" if held else token})


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent, process group, session) of `pid`, None when it is gone."""
    full = _full_stat(pid)
    return None if full is None else full[:4]


def started_at(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): with the pid, the identity of a process."""
    full = _full_stat(pid)
    return None if full is None else full[4]


def own_token() -> str | None:
    """The innermost run token this process carries (None outside a run)."""
    held = os.environ.get(TOKEN_ENV)
    return held.rsplit(":", 1)[-1] if held else None


def _full_stat(pid: int) -> tuple[str, int, int, int, int] | None:
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return (fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]),
                int(fields[19]))
    except (IndexError, ValueError):
        return None


def _tokens(pid: int) -> set[str]:
    """The run tokens in the environment `pid` started with (empty when it cannot be read)."""
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return set()
    prefix = TOKEN_ENV.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(prefix):
            return set(entry[len(prefix):].decode(errors="replace").split(":"))
    return set()


def _table() -> dict[int, tuple[str, int, int, int, int]]:
    """Every process there is, by pid: (state, parent, group, session, start time); empty
    without /proc."""
    try:
        names = os.listdir(_PROC)
    except OSError:
        return {}
    table = {}
    for name in names:
        if name.isdigit():
            stat = _full_stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def _ancestors(table: dict[int, tuple[str, int, int, int, int]]) -> set[int]:
    """This process and its ancestors: never killed."""
    pid, seen = os.getpid(), set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        stat = table.get(pid) or _stat(pid)
        pid = stat[1] if stat is not None else 0
    return seen


def find(token: str | None = None, sessions: Iterable[int] = (), groups: Iterable[int] = (),
         roots: Iterable[int] = (), spare: Iterable[int] = (), carrying: str | None = None,
         known: dict[int, int] | None = None) -> set[int]:
    """The live processes (not zombies) carrying `token`, in one of `sessions` or `groups`, or
    one of `roots` or descending from one; never this process nor its ancestors, nor `spare`.
    `carrying`: a process found by its session or group must carry that token too (the number
    may have been given again). `known`: pid -> start time of the roots as first seen; a root
    now another process (a recycled pid) is not one (filled in for the roots not in it)."""
    table = _table()
    keep = _ancestors(table) | set(spare)
    sessions, groups = set(sessions), set(groups)
    found = set()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, pgrp, sid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
        by_token = bool(token) and token in _tokens(pid)
        by_id = (sid in sessions or pgrp in groups) and (carrying is None
                                                         or carrying in _tokens(pid))
        if by_token or by_id:
            found.add(pid)
    known = {} if known is None else known
    stack = []
    for pid in roots:
        if pid in table and known.setdefault(pid, table[pid][4]) == table[pid][4]:
            stack.append(pid)
    found.update(stack)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return {pid for pid in found - keep if table[pid][0] not in ("Z", "X")}


def end(token: str | None = None, sessions: Iterable[int] = (), groups: Iterable[int] = (),
        roots: Iterable[int] = (), reap: bool = False, wait_s: float = END_WAIT_S,
        spare: Iterable[int] = (), carrying: str | None = None) -> int:
    """Kill (SIGKILL) what `find` finds, again until nothing is left or `wait_s` has passed;
    how many were killed. `reap`: collect this process's dead children too (the worker, which
    owns them all, at its end). Sessions and groups are this caller's to vouch for: their leader
    not yet reaped, or `carrying` given. Without /proc, the groups are killed whole."""
    sessions, groups, roots, spare = list(sessions), list(groups), list(roots), list(spare)
    if not (token or sessions or roots or reap) and all(_empty_group(g) for g in groups):
        return 0    # nothing is left in the groups (each run's end: no table of /proc to read)
    if not os.path.isdir(_PROC):     # what cannot be found without /proc
        for group in groups:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
    killed: set[int] = set()
    known: dict[int, int] = {}
    deadline = time.monotonic() + wait_s
    while True:
        if reap:
            _reap()
        alive = find(token, sessions, groups, roots, spare, carrying, known)
        if not alive or time.monotonic() > deadline:
            return len(killed)
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        killed |= alive
        time.sleep(POLL_S)


def _empty_group(group: int) -> bool:
    """Whether no process (a zombie counts) is in process group `group`."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False    # someone's it is (EPERM): looked at through /proc
    return False


def _reap() -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Linux: orphans of this process's descendants become its children (PR_SET_CHILD_SUBREAPER),
    so none escapes `end(roots=(os.getpid(),))` by losing its parent."""
    return _prctl(36, 1)


def die_with_parent() -> bool:
    """Linux: SIGKILL to this process when the thread that started it ends (PR_SET_PDEATHSIG)."""
    return _prctl(1, int(signal.SIGKILL))


def end_descendants() -> None:
    """The end of a worker's job: every process it started ends, multiprocessing's resource
    tracker last and by itself (its pipe closed, once nothing else holds it, it unlinks the
    semaphores the runs left, then leaves), so nothing is left in /dev/shm."""
    tracker = _resource_tracker()
    pid = tracker._pid if tracker is not None else None
    spare = (pid,) if pid else ()
    if tracker is not None and pid:
        # (the tracker reads its pipe's end only once every process holding it is gone: it
        # still outlives what is killed below, and its own exit overlaps their deaths)
        with contextlib.suppress(OSError):
            os.close(tracker._fd)
    end(roots=(os.getpid(),), sessions=(os.getpid(),), reap=True, spare=spare)
    if tracker is not None and pid:
        deadline = time.monotonic() + END_WAIT_S
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break                # not ours to wait for: swept below
            time.sleep(POLL_S)
        end(roots=(os.getpid(),), sessions=(os.getpid(),), reap=True)


def _resource_tracker() -> Any:
    """multiprocessing's resource tracker of this process, when it started one."""
    module = sys.modules.get("multiprocessing.resource_tracker")
    tracker = getattr(module, "_resource_tracker", None)
    if tracker is None or getattr(tracker, "_pid", None) is None:
        return None
    return tracker


@contextlib.contextmanager
def quiet_fd2() -> Iterator[None]:
    """fd 2 on /dev/null for what is started inside (multiprocessing's resource tracker: its
    warnings about what a killed run left are not the user's to read)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def owned() -> Iterator[str]:
    """A diagnose in this process (the Python API): what it starts is killed when it is over,
    however it ends: the children of this process that were not there before it (and theirs),
    and what carries a fresh token put in the environment meanwhile (a program it executed
    that left this process's tree; a forked child shows only the environment it was executed
    with in /proc, hence the children). The token is taken back from the environment."""
    token = new_token()
    held = os.environ.get(TOKEN_ENV)
    before = find(roots=(os.getpid(),))
    os.environ[TOKEN_ENV] = with_token({TOKEN_ENV: held} if held else {}, token)[TOKEN_ENV]
    try:
        yield token
    finally:
        if held is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = held
        # this process's resource tracker stays: multiprocessing here would warn that it died
        tracker = _resource_tracker()
        keep = before | ({tracker._pid} if tracker is not None else set())
        started = find(roots=(os.getpid(),)) - keep
        end(token, roots=started, spare=keep)


class Guardian:
    """A process of ampdoctor's own that ends the run's processes once the pipe from this
    process closes: when this process is done (`close`), or dies, SIGKILL included. It is in a
    session of its own (a SIGKILL to this process's group does not reach it) and holds none of
    this process's files."""

    def __init__(self, token: str) -> None:
        self.token = token
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        self.proc: subprocess.Popen[bytes] | None = None
        with contextlib.suppress(OSError):
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), "guard", token],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, env=env)

    def watch_session(self, sid: int) -> None:
        """Also end the processes of session `sid` (the worker's, its leader alive now)."""
        self._send(f"{sid} {started_at(sid) or 0}")

    def remove(self, folder: str) -> None:
        """Also remove `folder` (the run's temporary folder) once the run's processes ended."""
        self._send(f"temp {folder}")

    def close(self) -> None:
        """Done: the caller ended the run; the guardian sweeps by the token only (a session the
        caller reaped may since be a stranger's) and leaves; waited for briefly, so that it is
        not left a zombie of a long-lived caller."""
        self._send("done")
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=GUARDIAN_WAIT_S)

    def _send(self, line: str) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(f"{line}\n".encode())
                self.proc.stdin.flush()


def _guard(token: str) -> None:
    """The guardian: read sessions until the pipe closes, then end the run: by the token when
    the caller said it was done, else by the token and the sessions that are still the run's
    (a session whose id now names another leader is a stranger's)."""
    for sig in (signal.SIGINT, signal.SIGHUP):    # a terminal's signals are the CLI's to handle
        signal.signal(sig, signal.SIG_IGN)
    sessions: dict[int, int] = {}
    folders: list[str] = []
    done = False
    for line in sys.stdin.buffer:
        if line.startswith(b"temp "):
            folders.append(os.fsdecode(line[5:].rstrip(b"\n")))
            continue
        words = line.split()
        if words == [b"done"]:
            done = True
        with contextlib.suppress(ValueError):
            sid, started = (int(w) for w in words)
            sessions[sid] = started
    if done:
        end(token)
    else:
        end(token, [sid for sid, started in sessions.items()
                    if started_at(sid) in (None, started)])
    for folder in folders:       # nothing of the run is left to write in them
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "guard":
        _guard(sys.argv[2])
