"""The worker process, started: its pipes, its temporary folder, its run token and the
guardian that ends its processes if the CLI dies (`Launch`), and, for a script's diagnose,
started before the CLI has parsed its own options (`prestart`).

A script's diagnose waits first of all for the fork server its runs start from to import torch
and the script's libraries (about one plain start-up of the script). The CLI's own start
(typer, rich, pydantic: half a second) used to come before that; `prestart`, called first thing
by the console script, starts the worker at once with the script's path in its environment
(`WARM_ENV`), and the worker starts the fork server first thing, while the CLI parses. The job
follows on the worker's stdin once the CLI has it (`Launch.send_job`); a command that ends
before (a usage error) ends the worker with it (`discard`, at exit, and the worker dies with
its parent in any case).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from . import processes
from .errors import LaunchError

#: the environment variable that hands the worker the script to warm up for (`prestart`)
WARM_ENV = "AMPDOCTOR_WARM"


def _child_command() -> list[str]:
    """`python -c` with ampdoctor's own folder first on sys.path, never the current directory
    (a user's `torch.py` or `ampdoctor/` in it must not shadow the real ones; the console
    script does not put the working directory on sys.path either). Its first act, before the
    worker's own modules are imported, is the script's fork server (`spawn.warm_early`)."""
    root = str(Path(__file__).resolve().parents[2])
    return [sys.executable, "-c",
            f"import sys; sys.path[0] = {root!r}; "
            "from ampdoctor.script.spawn import warm_early; warm_early(); "
            "from ampdoctor.supervise.worker import main; main()"]


class Launch:
    """The worker, started and waiting for its job on stdin (one JSON document)."""

    def __init__(self, warm: tuple[str, str] | None = None) -> None:
        """`warm`: (script, cwd) of a script's diagnose, whose fork server the worker starts
        first thing (`WARM_ENV`), before its job comes."""
        # the run's temporary folder: what ampdoctor writes there goes with the run, even when
        # the worker is killed (removed by `close`, or by the guardian when this process dies)
        self.temp = tempfile.mkdtemp(prefix="ampdoctor-")
        # where the child's faulthandler writes its stacks on SIGUSR2
        self.dump_path = os.path.join(self.temp, "stacks.txt")
        Path(self.dump_path).touch()
        self.read_fd, write_fd = os.pipe()
        self.write_fd = write_fd
        # every process of the run carries the token; the guardian ends them if this one dies
        self.token = processes.new_token()
        self.guardian = processes.Guardian(self.token)
        self.guardian.remove(self.temp)
        env = processes.with_token(dict(os.environ, PYTHONUNBUFFERED="1",
                                        **{processes.TEMP_ENV: self.temp}), self.token)
        env.pop("PYTHONSTARTUP", None)
        if warm is not None:
            env[WARM_ENV] = json.dumps({"script": warm[0], "cwd": warm[1],
                                        "parent": os.getpid()})
        try:
            self.proc = subprocess.Popen(
                _child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True, env=env)
        except OSError as exc:
            os.close(self.read_fd)
            os.close(write_fd)
            shutil.rmtree(self.temp, ignore_errors=True)
            self.guardian.close()
            raise LaunchError(f"could not start the process that runs the loop: {exc}",
                              cause=exc) from exc
        os.close(write_fd)
        self.guardian.watch_session(self.proc.pid)

    def send_job(self, wire: str) -> None:
        """The job, one JSON line on stdin: the run source on the wire, the event channel,
        the stacks file."""
        stdin = self.proc.stdin
        assert stdin is not None
        message = {"spec": wire, "channel_fd": self.write_fd, "dump_path": self.dump_path,
                   "parent": os.getpid()}
        try:
            stdin.write(json.dumps(message).encode() + b"\n")
            stdin.close()
        except OSError:
            pass        # it died at once: seen by the watch as an exit without a result

    def discard(self) -> None:
        """A worker whose job never came: ended, with whatever it started, and its folder."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        processes.end(self.token, sessions=(self.proc.pid,))
        self.guardian.close()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        with contextlib.suppress(OSError):
            os.close(self.read_fd)
        shutil.rmtree(self.temp, ignore_errors=True)


#: the worker `prestart` started, until a diagnose takes it (`take`)
_PRESTARTED: Launch | None = None


def take() -> Launch:
    """The worker for a diagnose: the one `prestart` started, else a new one."""
    global _PRESTARTED
    launch, _PRESTARTED = _PRESTARTED, None
    return launch if launch is not None else Launch()


def _discard_unused() -> None:
    global _PRESTARTED
    launch, _PRESTARTED = _PRESTARTED, None
    if launch is not None:
        launch.discard()


def script_of(argv: list[str]) -> str | None:
    """The script a command line diagnoses (`diagnose [OPTIONS] SCRIPT.py [OPTIONS] [-- ARGS]`,
    the first existing `.py` file before `--`), None for any other command, for `--help`, and
    where the CLI would not start a worker (`AMPDOCTOR_IN_PROCESS`, a launcher's rank: script
    mode refuses WORLD_SIZE > 1)."""
    if not argv or argv[0] != "diagnose":
        return None
    if os.environ.get("AMPDOCTOR_IN_PROCESS", "").strip().lower() in ("1", "true", "yes"):
        return None
    world = os.environ.get("WORLD_SIZE", "1").strip()
    if world.isdigit() and int(world) > 1:
        return None
    head = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if any(arg in ("-h", "--help") for arg in head):
        return None
    for arg in head:
        if arg.endswith(".py") and os.path.isfile(arg):
            return os.path.abspath(arg)
    return None


def prestart(argv: list[str]) -> None:
    """For `ampdoctor diagnose SCRIPT.py ...`: the worker started now, its fork server warming
    up for the script while the CLI imports its own modules and parses its options. Anything
    that goes wrong here is left to the diagnose's own start, where it is reported."""
    global _PRESTARTED
    script = script_of(argv)
    if script is None or _PRESTARTED is not None:
        return
    try:
        launch = Launch(warm=(script, os.getcwd()))
    except Exception:  # noqa: BLE001 - the diagnose starts its worker itself and says why
        return
    _PRESTARTED = launch
    atexit.register(_discard_unused)
