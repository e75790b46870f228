"""Shared helpers: run the CLI (in this process, or as the installed console script), find the
line a recipe marks as the bug, and diagnose each sample config once per test session."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
CONFIGS = ROOT / "sample_configs"

# Two xdist workers on two cores: one torch thread each, or they fight over the cores (the
# spawned DDP ranks and the subprocesses inherit it). Set before torch is imported anywhere.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def record(self) -> dict:
        return json.loads(self.stdout)


def ampdoctor_command() -> list[str]:
    exe = shutil.which("ampdoctor")
    return [exe] if exe else [sys.executable, "-m", "ampdoctor"]


def run_cli_process(*args: str, cwd: Path | None = None, env: dict | None = None,
                    timeout: float = 300) -> CliResult:
    """The installed console script in a process of its own: for what the process boundary is
    (exit codes of a real process, signals, os._exit, bytecode, torch never imported)."""
    full_env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    full_env.update(env or {})
    proc = subprocess.run(ampdoctor_command() + [str(a) for a in args], capture_output=True,
                          text=True, cwd=cwd, env=full_env, timeout=timeout)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


# ------------------------------------------------------------------ the CLI in this process
def _process_state() -> dict:
    """What a diagnose must leave as it found it, so that in-process runs cannot leak into
    one another: torch's patched callables and global settings, the interpreter's path,
    modules, signal handlers, timers, threads and working directory."""
    state: dict = {
        "cwd": os.getcwd(), "sys.path": list(sys.path), "os._exit": os._exit,
        "signals": {s: signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGTERM,
                                                     signal.SIGHUP, signal.SIGINT)},
        "itimer": signal.getitimer(signal.ITIMER_REAL),
        "dont_write_bytecode": sys.dont_write_bytecode,
        "threads": {t.ident for t in threading.enumerate() if not t.daemon},
        "modules": set(sys.modules),
    }
    if "torch" in sys.modules:
        import torch
        from torch.optim import optimizer as opt_module

        from ampdoctor.probe import patches, recorder, wrappers

        patcher = patches.Patcher()
        wrappers.install(patcher)
        patched = [(t, n) for t, n, _ in patcher.patched]
        patcher.undo()
        state.update({
            "patched": {(id(t), n): t.__dict__.get(n) if isinstance(t, type) else getattr(t, n)
                        for t, n in patched},
            "optimizer hooks": dict(opt_module._global_optimizer_pre_hooks),
            "recorder": recorder.ACTIVE,
            "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "threads/torch": torch.get_num_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"),
            "rng": torch.get_rng_state().numpy().tobytes(),
            "distributed": torch.distributed.is_available() and torch.distributed.is_initialized(),
        })
    return state


_LIBRARY_ROOTS = tuple({str(Path(p).resolve()) for p in
                        (sys.prefix, sys.base_prefix, sys.exec_prefix, ROOT / "ampdoctor")})


def _is_user_file(path: str | None) -> bool:
    """A module from a spec's project (recipes, a test's tmp_path), not from a library."""
    if not path or not os.path.isabs(path):     # torch.ops and torch.classes: "_ops.py"
        return False
    resolved = str(Path(path).resolve())
    installed = f"{os.sep}site-packages{os.sep}" in resolved or \
        f"{os.sep}dist-packages{os.sep}" in resolved    # any environment's installed packages
    return not installed and not resolved.startswith(_LIBRARY_ROOTS) \
        and not resolved.startswith(str(ROOT / "tests"))


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None,
            timeout: float = 300) -> CliResult:
    """`ampdoctor ARGS` through its Typer app in this process (no interpreter start, no second
    torch import); the same stdout, stderr and exit code a process would give. Afterwards the
    process must be as it was before: in-process runs leak nothing into the next test.
    `timeout` is the process runner's; in this process the spec's own bounds apply."""
    from typer.testing import CliRunner

    from ampdoctor.cli import app

    full_env = {"NO_COLOR": "1", "COLUMNS": "200"}
    full_env.update(env or {})
    before = _process_state()
    previous = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, [str(a) for a in args], env=full_env,
                                    prog_name="ampdoctor", catch_exceptions=True)
    finally:
        os.chdir(previous)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # what the interpreter would have printed on the way out
        stderr += "".join(traceback.format_exception(*result.exc_info))
    after = _process_state()
    # (torch's state is compared once torch was imported before: the first diagnose imports it)
    leaked = {key: (before[key], after[key]) for key in after
              if key in before and key != "modules" and before[key] != after[key]}
    user_modules = sorted(name for name in after["modules"] - before["modules"]
                          if _is_user_file(getattr(sys.modules.get(name), "__file__", None)))
    if user_modules:
        leaked["user modules"] = user_modules
    assert not leaked, f"ampdoctor {' '.join(map(str, args))} left the process changed: {leaked}"
    return CliResult(result.exit_code, result.stdout, stderr)


def assert_undivided_loss(result: CliResult, script: Path) -> None:
    """The record of `result` fails at fp32-accum with one finding: the loss not divided by K
    (K = 4: the update 4x the reference's), at the script's `# BUG:` line."""
    assert result.returncode == 1, result.stderr
    (finding,) = result.record["findings"]
    assert (finding["kind"], finding["rung"]) == ("missing-accumulation-average", "fp32-accum")
    assert finding["evidence"]["ratio"] == pytest.approx(4.0, rel=1e-3)
    assert finding["location"]["line"] == marked_line(script, "missing-accumulation-average")


def marked_line(path: Path, kind: str) -> int:
    """The line of `path` that carries `# BUG: <kind>`."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if re.search(rf"# BUG: {re.escape(kind)}\b", line):
            return number
    raise AssertionError(f"{path} has no '# BUG: {kind}' marker")


@pytest.fixture
def records_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"


# ------------------------------------------------- one diagnose per sample config per session
@dataclass
class Diagnosed:
    """`ampdoctor diagnose CONFIG --json --out OUT`, run once and shared by the tests that
    check what it found. `out` holds the records it saved (this diagnose's alone)."""
    result: CliResult
    out: Path

    @property
    def returncode(self) -> int:
        return self.result.returncode

    @property
    def record(self) -> dict:
        return self.result.record

    @property
    def stderr(self) -> str:
        return self.result.stderr


class _DiagnoseCache:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, Diagnosed] = {}

    def __call__(self, name: str) -> Diagnosed:
        """`name`: a sample config's path under sample_configs/, without `.yaml`."""
        if name not in self.done:
            out = self.root / name.replace("/", "__")
            self.done[name] = Diagnosed(
                run_cli("diagnose", CONFIGS / f"{name}.yaml", "--json", "--out", out), out)
        return self.done[name]


@pytest.fixture(scope="session")
def diagnosed(tmp_path_factory) -> _DiagnoseCache:
    """diagnosed("healthy_sgd"): the sample config's diagnose, run at most once per session
    (per xdist worker: tests sharing a config carry the same xdist_group)."""
    return _DiagnoseCache(tmp_path_factory.mktemp("diagnosed"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` under pytest 9: pytest-xdist 3.8 names a grouped test `nodeid@group`
    by setting `item._nodeid`, which pytest 9 no longer reads (the id is `item._id`), so every
    xdist_group mark is ignored. Name it here the way xdist meant to."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:     # pytest < 9: xdist's own renaming works
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        if names and "@" not in item.nodeid and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")
