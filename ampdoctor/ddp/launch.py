"""Start the ranks of the `ddp-sync` rung, bounded in time, and bring back what each recorded.

Two ways in:

- **spawned** (a plain `ampdoctor diagnose`): `ddp.world_size` processes on this machine, gloo
  on CPU or nccl on CUDA, on a free port;
- **under torchrun** (or `RANK` / `WORLD_SIZE` / `MASTER_ADDR` / `MASTER_PORT` in the environment,
  on one node or several): every launched process is a supervisor for one rank. Rank 0 runs the
  ladder; the others wait for it (`TorchrunGroup.serve`). At the ddp-sync rung each supervisor
  starts its rank as a child process, which joins a process group on rank 0's host (nccl on CUDA,
  so the check crosses real nodes); the results travel through the launch's key-value store.

Either way, the loop runs in child processes that a supervisor can kill: a rank that raises
writes its error at once, and every other rank (blocked in a collective its peer will never
join) is ended within a second or two; the whole run is bounded by `ddp.timeout_s`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from ..core import processes as run_processes
from ..core.errors import LaunchError
from ..core.safetext import exc_text, inert

#: How often supervisors look at their ranks and at the others' results.
POLL_S = 0.2
#: The default of `ddp.timeout_s`: the whole multi-process run, loading included.
DEFAULT_TIMEOUT_S = 300.0

KEY_PREFIX = "ampdoctor/"
#: After a rank's error, how long to wait for the other ranks' results (the cause may be a
#: peer's error that the first one only echoes).
ERROR_SETTLE_S = 2.0
#: Under torchrun, how long the other ranks wait after rank 0 finished before exiting non-zero.
EXIT_GRACE_S = 2.0


#: The launch this process joined (`TorchrunGroup`), or None: the rung spawns its own ranks.
GROUP: TorchrunGroup | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------ the child
def _child(rank: int, world_size: int, spec_path: str, master: str, port: int,
           timeout_s: float, result_path: str) -> None:
    """One rank. Never raises: everything it has to say is in its result file."""
    os.dup2(2, 1)  # the user's prints must not reach ampdoctor's stdout (--json)
    import faulthandler
    import signal

    # On SIGUSR1 (the supervisor's deadline) write where this rank is stuck.
    stack_file = open(result_path + ".stack", "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    result: dict[str, Any] = {"rank": rank}
    stage = "launch"
    try:
        import torch
        import torch.distributed as dist

        from ..loading import resolve_device
        from ..spec import from_wire
        from .rank import run_rank

        # A child of a torchrun worker inherits the agent's settings: with this one set, rank 0
        # would not serve the rung's own store at master:port, and every rank would wait for it.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        device = resolve_device(from_wire(spec_path).device)
        if device.type == "cuda":
            # under torchrun across nodes the GPU is the node-local rank's
            local = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local % torch.cuda.device_count())
        elif "OMP_NUM_THREADS" not in os.environ:
            # world_size ranks on one machine's cores: each its share, not all of them each
            # (as torchrun does with OMP_NUM_THREADS=1); oversubscribed ranks run 3-4x slower
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world_size, 1)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://{master}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        stage = "loop"
        Path(result_path + ".joined").touch()
        run_rank(rank, world_size, spec_path, result)
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor
        result["error_time"] = time.time()   # the first error is the cause, later ones echoes
        result["error"] = exc_text(exc)
        result["stage"] = stage
        finder = result.get("_finder")
        site = finder.from_traceback(exc.__traceback__) if finder is not None else None
        if site is not None:
            result["error_site"] = [site.file, site.line, site.function]
    result.pop("_finder", None)
    tmp = result_path + ".part"
    Path(tmp).write_text(json.dumps(result))
    os.replace(tmp, result_path)
    # Leave without interpreter finalisers: gloo's threads can abort a process at exit, and
    # a rank whose peer failed may still be blocked in a collective (its supervisor kills it).
    try:
        import torch.distributed as dist
        if "error" not in result and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the work is done and recorded
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(rank: int, world_size: int, spec_path: str, master: str, port: int,
           timeout_s: float, result_path: str) -> BaseProcess:
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(
        target=_child, args=(rank, world_size, spec_path, master, port, timeout_s, result_path),
        name=f"ampdoctor-rank{rank}", daemon=True)
    try:
        process.start()
    except OSError as exc:
        raise LaunchError(f"could not start rank {rank}: {exc}") from exc
    return process


def _read(path: str) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _where_stuck(processes: dict[int, Any], paths: dict[int, str]) -> dict[int, dict[str, Any]]:
    """Ask every rank still running for its stack (faulthandler, SIGUSR1); {rank: result}."""
    import signal

    alive = {r: p for r, p in processes.items() if p.is_alive()}
    for process in alive.values():
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(1.0)
    stuck = {}
    for rank in alive:
        try:
            stack = Path(paths[rank] + ".stack").read_text()
        except OSError:
            stack = ""
        stuck[rank] = {"rank": rank, "hung": True, "stack": stack,
                       "stage": "loop" if os.path.exists(paths[rank] + ".joined") else "launch"}
    return stuck


def _stop(processes: Iterable[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5)


def _supervise(processes: dict[int, Any], paths: dict[int, str], deadline: float,
               results: Callable[[], dict[int, dict[str, Any]]],
               world_size: int) -> dict[int, dict[str, Any]]:
    """Wait until every rank has a result, one has an error (the rest are killed), a rank died
    without one, or the deadline passed."""
    settle: float | None = None
    try:
        while True:
            found = results()
            if len(found) == world_size:
                return found
            if any("error" in r for r in found.values()):
                # The first error may be a peer's echo ("connection reset") of the real one,
                # whose result is still on its way: wait a moment for the others' results.
                settle = settle or time.monotonic() + ERROR_SETTLE_S
                if time.monotonic() > settle:
                    return found
            for rank, process in processes.items():
                if not process.is_alive() and _read(paths[rank]) is None:
                    found[rank] = {"rank": rank, "stage": "loop",
                                   "error": f"rank {rank} exited with code {process.exitcode} "
                                            "without a result (killed, or os._exit in the loop)"}
                    return found
            if time.monotonic() > deadline:
                return {**_where_stuck(processes, paths), **found}
            time.sleep(POLL_S)
    finally:
        _stop(processes.values())


def run_spawned(spec_path: str, world_size: int, timeout_s: float) -> dict[int, dict[str, Any]]:
    """All ranks on this machine; {rank: result} (a rank missing from it did not finish)."""
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="ampdoctor-ddp-",
                                     dir=run_processes.temp_root()) as folder:
        paths = {r: os.path.join(folder, f"rank{r}.json") for r in range(world_size)}
        port = free_port()
        processes = {}
        try:
            for r in range(world_size):
                processes[r] = _start(r, world_size, spec_path, "127.0.0.1", port, timeout_s,
                                      paths[r])
        except LaunchError:
            _stop(processes.values())
            raise

        def results() -> dict[int, dict[str, Any]]:
            return {r: found for r, p in paths.items() if (found := _read(p)) is not None}

        return _supervise(processes, paths, deadline, results, world_size)


# ------------------------------------------------------------------------- under torchrun
def launched_rank() -> tuple[int, int] | None:
    """(rank, world_size) when this process was started by torchrun or an equivalent launch."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if world < 2 or not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        return None
    return rank, world


class TorchrunGroup:
    """The launch's key-value store, shared by the supervisors of every rank.

    torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT
    (TORCHELASTIC_USE_AGENT_STORE); a bare RANK/WORLD_SIZE launch has none, so rank 0 serves it.
    """

    def __init__(self, rank: int, world_size: int, connect_timeout_s: float = 120.0):
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.spec_path = ""
        self.master = os.environ["MASTER_ADDR"]
        serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        try:
            self.store = dist.TCPStore(self.master, int(os.environ["MASTER_PORT"]),
                                       world_size if serve else None, is_master=serve,
                                       timeout=timedelta(seconds=connect_timeout_s),
                                       wait_for_workers=False)
        except (RuntimeError, OSError, ValueError) as exc:
            raise LaunchError(f"rank {rank} could not reach the launch's store at "
                              f"{self.master}:{os.environ['MASTER_PORT']}: {exc}") from exc
        # torchrun restarts reuse the store: keys carry the restart count
        self.prefix = KEY_PREFIX + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/"

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _has(self, name: str) -> bool:
        return self.store.check([self._key(name)])

    def _get(self, name: str) -> str:
        return self.store.get(self._key(name)).decode()

    def _set(self, name: str, value: str) -> None:
        self.store.set(self._key(name), value)

    # rank 0 -------------------------------------------------------------------------------
    def run_ranks(self, spec_path: str, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Rank 0 at the ddp-sync rung: tell every supervisor to start its rank; gather."""
        self.spec_path = spec_path
        port = free_port()
        self._set("ddp", json.dumps({"port": port, "timeout_s": timeout_s}))
        try:
            found = self._run_own_rank(port, timeout_s)
        finally:
            self._set("abort", "1")   # every supervisor stops its rank, if still running
        return found

    def finish(self, exit_code: int) -> None:
        """Rank 0 is done: the other ranks exit with its code."""
        self._set("exit", str(exit_code))

    # every rank ----------------------------------------------------------------------------
    def _run_own_rank(self, port: int, timeout_s: float) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        with tempfile.TemporaryDirectory(prefix="ampdoctor-ddp-",
                                     dir=run_processes.temp_root()) as folder:
            path = os.path.join(folder, f"rank{self.rank}.json")
            process = _start(self.rank, self.world_size, self.spec_path, self.master, port,
                             timeout_s, path)
            posted = False

            def results() -> dict[int, dict[str, Any]]:
                nonlocal posted
                own = _read(path)
                if own is not None and not posted:
                    self._set(f"result/{self.rank}", json.dumps(own))
                    posted = True
                if self._has("abort") and self.rank != 0:
                    return {r: {} for r in range(self.world_size)}   # rank 0 is done
                found = {}
                for r in range(self.world_size):
                    if self._has(f"result/{r}"):
                        found[r] = json.loads(self._get(f"result/{r}"))
                return found

            found = _supervise({self.rank: process}, {self.rank: path}, deadline, results,
                               self.world_size)
            if not posted and self.rank in found:
                self._set(f"result/{self.rank}", json.dumps(found[self.rank]))
            return found

    def serve(self, spec: Any) -> int:
        """A rank other than 0: run its rank when rank 0 asks, then exit with rank 0's code.
        `spec`: the Spec, with this command line's overrides (the same on every rank)."""
        from ..spec import to_wire
        self.spec_path = to_wire(spec)
        ran = False
        while True:
            try:
                if self._has("exit"):
                    code = int(self._get("exit"))
                    if code:
                        # torchrun stops every worker once one exits non-zero: give rank 0
                        # time to leave on its own first (its record is already written)
                        time.sleep(EXIT_GRACE_S)
                    return code
                if not ran and self._has("ddp"):
                    order = json.loads(self._get("ddp"))
                    self._run_own_rank(order["port"], float(order["timeout_s"]))
                    ran = True
            except (RuntimeError, OSError) as exc:   # the store went away: rank 0 is gone
                print(f"ampdoctor: rank {self.rank}: lost rank 0 ({inert(exc_text(exc))})",
                      file=sys.stderr)
                return 3
            time.sleep(POLL_S)
