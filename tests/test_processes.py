"""Every process a run starts has ended when ampdoctor exits, on every path (issue 35).

The runs are given a marker in their environment (LEAK_MARK=<uuid>), which every process they
start inherits; after ampdoctor exits, /proc is scanned for a live process carrying it. The
recipes (`recipes/leaky_helpers.py`, `recipes/scripts/leaky_script.py`) start persistent
DataLoader workers, a daemonic multiprocessing child and a `sleep 300` helper, and hold them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from ampdoctor.core import processes
from conftest import CONFIGS, RECIPES, ROOT, ampdoctor_command, run_cli_process

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")

GUARDIAN = "processes.py guard"


def _carrying(mark: str) -> list[tuple[int, str]]:
    """Live processes (not zombies) whose environment holds LEAK_MARK=mark, with their command."""
    found = []
    needle = f"LEAK_MARK={mark}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[stat.rfind(")") + 2] not in "ZX":
            found.append((int(name), command))
    return found


def _assert_none_left(mark: str, grace_s: float = 0.0) -> None:
    """Nothing of the run is alive. Without `grace_s` (ampdoctor ended the run before it
    exited) only ampdoctor's guardian may take a moment to leave (it holds none of the caller's
    files); with it (ampdoctor was SIGKILLed: the guardian ends the run), everything must be
    gone within `grace_s`."""
    try:
        deadline = time.monotonic() + grace_s
        while grace_s and _carrying(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in _carrying(mark) if GUARDIAN not in p[1]]
        assert left == [], f"left running after ampdoctor exited: {left}"
        deadline = time.monotonic() + 5.0
        while _carrying(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _carrying(mark) == []
        # and no temporary folder of ampdoctor's (a script's scratch holds its checkpoints)
        assert _ampdoctor_temp(mark) == [], f"left in {_temp(mark)}: {_ampdoctor_temp(mark)}"
    finally:
        for pid, _ in _carrying(mark):      # never leave them to the next test
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(_temp(mark), ignore_errors=True)


def _temp(mark: str) -> Path:
    """The run's TMPDIR: a folder of its own (short: multiprocessing puts sockets in it)."""
    return Path(tempfile.gettempdir()) / f"adt-{mark[:12]}"


def _env(mark: str, **extra: str) -> dict[str, str]:
    _temp(mark).mkdir()
    return dict(os.environ, NO_COLOR="1", COLUMNS="200", LEAK_MARK=mark,
                TMPDIR=str(_temp(mark)), **extra)


def _ampdoctor_temp(mark: str) -> list[str]:
    return sorted(p.name for p in _temp(mark).glob("ampdoctor-*"))


def _spec(tmp_path: Path, timeout_s: float | None = None) -> Path:
    text = (CONFIGS / "leaky_helpers.yaml").read_text().replace(
        "project_root: ../recipes", f"project_root: {RECIPES}")
    if timeout_s is not None:
        text += f"timeout_s: {timeout_s}\n"
    spec = tmp_path / "leaky.yaml"
    spec.write_text(text)
    return spec


def _interruptible() -> None:
    """SIGINT as a terminal gives it: a test run started in the background of a shell without
    job control inherits it ignored (Python then installs no KeyboardInterrupt), and the CLI
    would never see the Ctrl-C these tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: list[str], env: dict[str, str], ready: Path) -> subprocess.Popen[str]:
    """The CLI in a process group of its own (as a CI runner starts it), once the run's
    helpers are up: its `ready` file written (a spec's loop), or its `sleep` helper running (a
    script's run writes its files into its scratch folder, so its ready file is not there)."""
    proc = subprocess.Popen(ampdoctor_command() + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=_interruptible)
    deadline = time.monotonic() + 240
    mark = env["LEAK_MARK"]
    while not ready.exists() and not any(command.startswith("sleep 300")
                                         for _, command in _carrying(mark)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never started its helpers"
        time.sleep(0.1)
    time.sleep(1.0)          # the DataLoader's persistent workers start right after
    return proc


def _saved(out: Path) -> dict:
    saved = list(out.glob("*.json"))
    assert len(saved) == 1, saved
    return json.loads(saved[0].read_text())


# ------------------------------------------------------------------------------ the module
def test_end_kills_a_token_s_tree_and_nothing_else():
    token = processes.new_token()
    env = processes.with_token(dict(os.environ), token)
    tree = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, time
        subprocess.Popen(["sleep", "300"])
        subprocess.Popen(["sleep", "300"], start_new_session=True, env={})
        time.sleep(300)
    """)], env=env)
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        deadline = time.monotonic() + 30
        while len(processes.find(token, roots=(tree.pid,))) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert tree.pid in processes.find(token)
        killed = processes.end(token, roots=(tree.pid,))
        assert killed == 3                              # the helper that cleared its env too
        assert tree.wait(timeout=10) == -signal.SIGKILL
        assert processes.find(token) == set()
        assert bystander.poll() is None                 # not the run's
    finally:
        bystander.kill()
        bystander.wait()


def test_a_recycled_session_group_or_pid_is_a_stranger_s():
    """A session, group or pid number that the kernel may have given again names another
    process: `find` leaves it alone unless it is vouched for (the token it must carry, the
    start time it had when first seen)."""
    token = processes.new_token()
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)   # no token
    ours = subprocess.Popen(["sleep", "300"], start_new_session=True,
                            env=processes.with_token(dict(os.environ), token))
    try:
        assert processes.find(sessions=(stranger.pid,)) == {stranger.pid}
        assert processes.find(groups=(stranger.pid,), carrying=token) == set()
        assert processes.find(groups=(ours.pid,), carrying=token) == {ours.pid}
        started = processes.started_at(stranger.pid)
        assert started is not None
        assert processes.find(roots=(stranger.pid,), known={stranger.pid: started}) \
            == {stranger.pid}
        assert processes.find(roots=(stranger.pid,), known={stranger.pid: started - 1}) == set()
    finally:
        for proc in (stranger, ours):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("how", ["owner-died", "recycled", "done"])
def test_the_guardian_ends_a_session_only_while_it_is_the_run_s(how):
    """Its owner dead, the guardian ends the sessions it was given, each while its id still
    names the leader it was given (same start time); after a clean `close` the caller has ended
    the run and reaped the leader, so the guardian sweeps by the token alone."""
    session = subprocess.Popen(["sleep", "300"], start_new_session=True)   # no token
    try:
        guardian = processes.Guardian(processes.new_token())
        assert guardian.proc is not None and guardian.proc.stdin is not None
        started = processes.started_at(session.pid)
        assert started is not None
        if how == "recycled":
            guardian._send(f"{session.pid} {started + 1}")
        else:
            guardian.watch_session(session.pid)
        if how == "done":
            guardian.close()
        else:
            guardian.proc.stdin.close()            # what the owner's death does
            guardian.proc.wait(timeout=30)
        killed = how == "owner-died"
        with contextlib.suppress(subprocess.TimeoutExpired):
            session.wait(timeout=5 if killed else 0.5)
        assert (session.returncode == -signal.SIGKILL) if killed else session.poll() is None
    finally:
        session.kill()
        session.wait()


def test_nested_tokens_end_only_the_inner_run():
    outer, inner = processes.new_token(), processes.new_token()
    env = processes.with_token(processes.with_token(dict(os.environ), outer), inner)
    assert env[processes.TOKEN_ENV] == f"{outer}:{inner}"
    first = subprocess.Popen(["sleep", "300"], env=processes.with_token(dict(os.environ), outer))
    second = subprocess.Popen(["sleep", "300"], env=env)
    try:
        deadline = time.monotonic() + 10
        while processes.find(outer) != {first.pid, second.pid}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert processes.end(inner) == 1
        assert second.wait(timeout=10) == -signal.SIGKILL
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()


def test_the_guardian_ends_the_run_when_its_owner_is_sigkilled():
    mark = uuid.uuid4().hex
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from ampdoctor.core import processes
        token = processes.new_token()
        guardian = processes.Guardian(token)
        env = processes.with_token(dict(os.environ), token)
        subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
        print("up", flush=True)
        time.sleep(300)
    """)], env=_env(mark), stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None and owner.stdout.readline() == "up\n"
    assert any(c.startswith("sleep 300") for _, c in _carrying(mark))
    owner.kill()
    owner.wait()
    _assert_none_left(mark, grace_s=10)


def test_an_in_process_diagnose_ends_what_its_loop_started(tmp_path):
    """The Python API: when `ampdoctor.diagnose` returns, the loop's processes have ended."""
    mark = uuid.uuid4().hex
    probe = textwrap.dedent(f"""
        import os, sys
        import ampdoctor
        record = ampdoctor.diagnose({str(_spec(tmp_path))!r}, save=False, rungs=["fp32-accum"])
        needle = b"LEAK_MARK={mark}"
        left = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid():
                try:
                    env = open(f"/proc/{{name}}/environ", "rb").read().split(b"\\0")
                    stat = open(f"/proc/{{name}}/stat").read()
                except OSError:
                    continue
                if needle in env and stat[stat.rfind(")") + 2] not in "ZX":
                    left.append(name)
        print(record.verdict, len(left), os.environ.get("AMPDOCTOR_RUN_TOKEN"))
    """)
    proc = subprocess.run([sys.executable, "-c", probe], env=_env(mark), capture_output=True,
                          text=True, timeout=240)
    try:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["healthy", "0", "None"]
    finally:
        _assert_none_left(mark)


# ------------------------------------------------------------------------------ spec mode
@pytest.mark.slow
def test_spec_mode_ends_the_loop_s_helpers_and_the_caller_reads_to_eof(tmp_path):
    """Persistent DataLoader workers, a daemonic child and `sleep 300`: exit 0, and
    capture_output (reading to EOF) returns because nothing holds ampdoctor's pipes."""
    mark = uuid.uuid4().hex
    result = run_cli_process("diagnose", _spec(tmp_path), "--out", tmp_path / "runs",
                             env=_env(mark), timeout=240)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    _assert_none_left(mark)


@pytest.mark.slow
def test_spec_mode_timeout_ends_the_hung_loop_and_its_helpers(tmp_path):
    mark = uuid.uuid4().hex
    result = run_cli_process("diagnose", _spec(tmp_path, timeout_s=3), "--out",
                             tmp_path / "runs", env=_env(mark, LEAK_HANG="1"), timeout=240)
    assert result.returncode == 3, result.stderr
    _assert_none_left(mark)


# ------------------------------------------------------------------------------ script mode
SCRIPT = RECIPES / "scripts" / "leaky_script.py"
REFERENCE = ["--reference-args", "--accum-steps 1 --batch-size 16"]


@pytest.mark.slow
def test_script_mode_ends_the_script_s_helpers(tmp_path):
    mark = uuid.uuid4().hex
    result = run_cli_process("diagnose", SCRIPT, "--out", tmp_path / "runs", *REFERENCE,
                             env=_env(mark), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "resource_tracker" not in result.stderr
    _assert_none_left(mark)


@pytest.mark.slow
def test_script_mode_timeout_ends_the_script_and_its_children(tmp_path):
    mark = uuid.uuid4().hex
    result = run_cli_process("diagnose", SCRIPT, "--out", tmp_path / "runs", *REFERENCE,
                             "--", "--hang", env=_env(mark, AMPDOCTOR_SCRIPT_TIMEOUT_S="5"),
                             timeout=300)
    assert result.returncode == 3, result.stderr
    # stopped by the run's own bound (the watchdog's backstop is 60 s past it)
    assert "did not reach its last step within 5 s" in result.stdout, result.stdout
    _assert_none_left(mark)


# ------------------------------------------------------------------------------ signals
def _hung_run(mode: str, tmp_path: Path, mark: str) -> subprocess.Popen[str]:
    """A diagnose whose loop (spec) or script hangs before its first step, its helpers up."""
    ready, out = tmp_path / "ready", tmp_path / "runs"
    if mode == "spec":
        args = ["diagnose", str(_spec(tmp_path)), "--out", str(out)]
        env = _env(mark, LEAK_HANG="1", LEAK_READY=str(ready))
    else:
        args = ["diagnose", str(SCRIPT), "--out", str(out), *REFERENCE, "--", "--hang"]
        env = _env(mark, LEAK_READY=str(ready))
    return _start(args, env, ready)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["spec", "script"])
@pytest.mark.parametrize("sig, to_group", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                           (signal.SIGHUP, False), (signal.SIGINT, True)])
def test_a_signal_writes_a_record_and_ends_the_run(tmp_path, mode, sig, to_group):
    """128+N, a record naming the signal and the rung it stopped, nothing left running, no
    traceback (to_group: Ctrl-C in a terminal, sent to the whole foreground group)."""
    mark = uuid.uuid4().hex
    proc = _hung_run(mode, tmp_path, mark)
    if to_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr
    record = _saved(tmp_path / "runs")
    assert (record["verdict"], record["exit_code"]) == ("error", 128 + sig)
    message = record["error"]["message"]
    assert message.startswith(f"interrupted by {signal.Signals(sig).name} ")
    if mode == "spec":       # the loop hangs in the first rung's first run
        assert message.startswith(f"interrupted by {signal.Signals(sig).name} during the "
                                  "reproducibility rung after 0 rung(s)")
    _assert_none_left(mark)
    shown = run_cli_process("report", next((tmp_path / "runs").glob("*.json")))
    assert shown.returncode == 0 and signal.Signals(sig).name in shown.stdout, shown.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["spec", "script"])
@pytest.mark.parametrize("to_group", [True, False])
def test_sigkill_to_the_cli_or_its_group_leaves_nothing(tmp_path, mode, to_group):
    """What a CI timeout sends (the group), or a kill -9 of ampdoctor alone: the worker (its
    own session) and everything the run started die too, within seconds."""
    mark = uuid.uuid4().hex
    proc = _hung_run(mode, tmp_path, mark)
    assert len(_carrying(mark)) >= 6       # the CLI, the worker, 2 DataLoader workers, 2 helpers
    if to_group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()
    proc.communicate(timeout=30)          # nothing holds the pipes
    _assert_none_left(mark, grace_s=10)


# ------------------------------------------------------------------------------ the early worker
def _fork_server_of(token: str, deadline_s: float = 60.0) -> list[int]:
    """The processes carrying `token` once one of them is the fork server (its imports under
    way), within `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = processes.find(token)
        commands = []
        for pid in found:
            with contextlib.suppress(OSError):
                commands.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        if any(b"forkserver" in c for c in commands):
            return sorted(found)
        time.sleep(0.05)
    raise AssertionError("the worker never started its fork server")


def test_a_worker_started_early_and_never_given_a_job_is_ended_with_its_folder(tmp_path):
    """`launch.prestart` starts the worker and, for the script, its fork server, before the
    CLI has parsed its options; a command that ends there discards them: every process
    carrying the run's token gone, the run's folder removed."""
    from ampdoctor.core import launch

    script = tmp_path / "train.py"
    script.write_text("import torch\n")
    started = launch.Launch(warm=(str(script), str(tmp_path)))
    try:
        assert len(_fork_server_of(started.token)) >= 2       # the worker and its server
        assert Path(started.temp).is_dir()
    finally:
        started.discard()
    assert processes.find(started.token) == set()
    assert not Path(started.temp).exists()


@pytest.mark.slow
def test_a_usage_error_after_the_early_start_leaves_nothing(tmp_path):
    """`ampdoctor diagnose SCRIPT --rungs nosuch-rung`: the worker the console script started
    for SCRIPT (before typer saw the bad option) is gone once the command exits 2."""
    mark = uuid.uuid4().hex
    result = run_cli_process("diagnose", SCRIPT, "--rungs", "nosuch-rung", "--out",
                             tmp_path / "runs", *REFERENCE, env=_env(mark))
    assert result.returncode == 2, result.stderr
    assert "nosuch-rung" in result.stderr and "Traceback" not in result.stderr
    _assert_none_left(mark)
