"""A script's diagnose pays its start-up once: the worker and its fork server start before the
CLI has parsed its options (`core.launch.prestart`), and on a CPU the runs that need only
the fp32 run go two at a time (`script.ahead`). Neither may change what is diagnosed."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from ampdoctor.core import launch
from conftest import RECIPES, marked_line, run_cli_process

AMP = RECIPES / "scripts" / "amp_recipe.py"
FIXED_PORT = RECIPES / "scripts" / "fixed_port.py"


# ------------------------------------------------------------------ which command lines start early
@pytest.fixture
def script(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    for name in ("AMPDOCTOR_IN_PROCESS", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return path


@pytest.mark.parametrize("argv, found", [
    (["diagnose", "train.py"], True),
    (["diagnose", "--json", "--out", "runs", "train.py", "--", "--lr", "1"], True),
    (["diagnose", "--reference-args", "--accum 1 --bs 32", "train.py"], True),
    (["diagnose", "spec.yaml"], False),               # a spec: no script to warm up for
    (["diagnose", "missing.py"], False),              # the CLI says what is wrong itself
    (["diagnose", "--", "train.py"], False),          # the script's own arguments
    (["diagnose", "--help", "train.py"], False),
    (["diagnose", "train.py", "-h"], False),
    (["scan", "train.py"], False),
    (["init", "train.py"], False),
    ([], False),
])
def test_only_a_script_s_diagnose_starts_its_worker_early(script, argv, found):
    assert launch.script_of(argv) == (str(script) if found else None)


@pytest.mark.parametrize("env", [{"AMPDOCTOR_IN_PROCESS": "1"}, {"WORLD_SIZE": "2"}])
def test_no_early_worker_where_the_cli_would_start_none(script, monkeypatch, env):
    """In-process runs start no worker; a launcher's rank is refused (exit 2) before any run."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch.script_of(["diagnose", "train.py"]) is None


# ------------------------------------------------------------------ overlapping runs, same answer
def _diagnose(tmp_path: Path, name: str, script: Path, args: list[str], ref: list[str],
              **env: str) -> dict:
    out = tmp_path / name
    result = run_cli_process("diagnose", script, "--json", "--out", out,
                             "--reference-args", " ".join(ref), "--", *args, env=env)
    assert result.returncode in (0, 1, 3), result.stderr
    record = json.loads(result.stdout)
    assert record["exit_code"] == result.returncode
    return record


def _shape(record: dict) -> list:
    return [[(r["id"], r["status"], r["summary"]) for r in record["rungs"]],
            [(f["rung"], f["kind"], f["message"]) for f in record["findings"]]]


def _overlap_refused(script: Path) -> str | None:
    from ampdoctor.script import ahead
    return ahead.early_overlap_refused(str(script))


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["none", "no-average", "no-update"])
def test_runs_side_by_side_give_the_record_of_runs_one_at_a_time(tmp_path, bug):
    """Each rung's status, summary (its numbers) and findings, and the runs in the order the
    ladder read them, are the same whether the runs overlap or not; a ladder that stops at its
    first failure (no ÷K: fp32-accum fails) stops the runs it started ahead; a run that raises
    beside another and alone too (no scaler.update: the fp16 run) is the script's failure, not
    a clash of two runs."""
    if _overlap_refused(AMP) is not None:
        pytest.skip(f"runs do not overlap here: {_overlap_refused(AMP)}")
    args = ["--amp", "--accum-steps", "4", "--batch-size", "8", "--bug", bug]
    ref = ["--amp", "--accum-steps", "1", "--batch-size", "32", "--bug", bug]
    overlapped = _diagnose(tmp_path, "overlapped", AMP, args, ref)
    alone = _diagnose(tmp_path, "alone", AMP, args, ref, AMPDOCTOR_SCRIPT_PARALLEL="0")
    assert _shape(overlapped) == _shape(alone)
    assert [(o["run"], o["optimizer_steps"]) for o in overlapped["output"]] == \
        [(o["run"], o["optimizer_steps"]) for o in alone["output"]]
    # the first two runs went side by side in the one, none did in the other
    assert [o["beside"] for o in overlapped["output"][:2]] == [True, True]
    assert not any(o["beside"] for o in alone["output"])
    assert not any("failed beside another run" in n for n in overlapped["notes"])
    assert overlapped["verdict"] == {"none": "healthy", "no-average": "failed",
                                     "no-update": "error"}[bug]
    if bug == "no-update":        # (exit 3: the script's own failure, in the fp16 run)
        finding = overlapped["findings"][0]
        assert (finding["rung"], finding["kind"]) == ("fp16-scaler", "loop-error")
        assert finding["location"]["line"] == marked_line(AMP, "loop-error")
    if bug == "no-average":
        finding = overlapped["findings"][0]
        assert (finding["rung"], finding["kind"]) == ("fp32-accum", "missing-accumulation-average")
        assert finding["evidence"]["ratio"] == pytest.approx(4.0, rel=1e-3)
        assert finding["location"]["line"] == marked_line(AMP, "missing-accumulation-average")
        # the ladder stopped there: the bf16 and fp16 runs started ahead were never read
        assert [o["run"] for o in overlapped["output"]][:2] == ["reference run", "fp32 run"]
        assert all(not o["run"].startswith(("bf16", "fp16")) for o in overlapped["output"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_script_that_cannot_run_twice_at_once_is_diagnosed_healthy(tmp_path):
    """The script binds a fixed port: a run beside another fails to. That run is run again
    alone and the rest one at a time, the record says so, and nothing is a loop error."""
    if _overlap_refused(FIXED_PORT) is not None:
        pytest.skip(f"runs do not overlap here: {_overlap_refused(FIXED_PORT)}")
    port = str(_free_port())
    record = _diagnose(tmp_path, "runs", FIXED_PORT,
                       ["--port", port, "--amp", "--accum-steps", "4", "--batch-size", "8"],
                       ["--port", port, "--amp", "--accum-steps", "1", "--batch-size", "32"])
    assert record["verdict"] == "healthy" and record["exit_code"] == 0
    statuses = {r["id"]: r["status"] for r in record["rungs"]}
    assert statuses["fp32-accum"] == statuses["fp16-scaler"] == statuses["skips"] == "pass"
    assert record["findings"] == []
    # one of the first two runs lost the port; after it no run overlapped (the one note names
    # that run alone)
    notes = [n for n in record["notes"] if "failed beside another run" in n]
    assert len(notes) == 1 and notes[0].startswith(("the reference run failed beside",
                                                    "the fp32 run failed beside")), notes
    assert " and the " not in notes[0].split(" failed beside")[0]
    # the try that failed beside another is not among the runs the record keeps
    assert len(record["output"]) == 10
    assert not any(o["beside"] for o in record["output"][2:])
    assert all("Address already in use" not in o["text"] for o in record["output"])


@pytest.mark.slow
def test_turned_off_no_run_overlaps_and_none_is_retried(tmp_path):
    port = str(_free_port())
    record = _diagnose(tmp_path, "runs", FIXED_PORT,
                       ["--port", port, "--accum-steps", "4", "--batch-size", "8"],
                       ["--port", port, "--accum-steps", "1", "--batch-size", "32"],
                       AMPDOCTOR_SCRIPT_PARALLEL="0")
    assert record["verdict"] == "healthy"
    assert not any(o["beside"] for o in record["output"])
    assert not any("failed beside another run" in n for n in record.get("notes", []))


def test_the_console_script_starts_a_script_s_worker_before_it_parses(script, monkeypatch):
    """`prestart` leaves the worker it started (for the script's fork server) for the
    diagnose to take; a second call starts no second one."""
    monkeypatch.setattr(launch, "_PRESTARTED", None)
    launch.prestart(["diagnose", "train.py", "--json"])
    started = launch._PRESTARTED
    try:
        assert started is not None and started.proc.poll() is None
        launch.prestart(["diagnose", "train.py"])
        assert launch._PRESTARTED is started
        assert launch.take() is started and launch._PRESTARTED is None
    finally:
        if started is not None:
            started.discard()
    launch.prestart(["diagnose", "spec.yaml"])
    assert launch._PRESTARTED is None


def test_the_overlap_check_reads_the_fp32_run(monkeypatch):
    """Runs overlap only on a CPU, in a script that forms no process group, where two of its
    runs fit in the free memory; the variable turns it off."""
    from ampdoctor.script import ahead
    from ampdoctor.script.child import Outcome

    monkeypatch.delenv(ahead.ENV, raising=False)
    monkeypatch.setattr(ahead, "_cores", lambda: 2)
    monkeypatch.setattr(ahead, "_available_memory", lambda: 8 << 30)
    assert ahead.overlap_refused(Outcome(device="cpu", peak_rss=1 << 30)) is None
    assert ahead.overlap_refused(Outcome(device="cuda:0", peak_rss=1 << 30)) == \
        "the script trains on cuda:0"
    assert ahead.overlap_refused(Outcome(device="cpu", peak_rss=5 << 30)) == \
        "not enough free memory for two runs"
    assert ahead.overlap_refused(Outcome(device="cpu", peak_rss=0)) == \
        "not enough free memory for two runs"      # (unknown: one at a time)
    assert ahead.overlap_refused(Outcome(device="cpu", peak_rss=1 << 30,
                                         group_of_one=["train.py:12"])) == \
        "the script forms a process group"
    monkeypatch.setattr(ahead, "_cores", lambda: 1)
    assert ahead.overlap_refused(Outcome(device="cpu", peak_rss=1 << 30)) == "one CPU core"
    monkeypatch.setattr(ahead, "_cores", lambda: 2)
    monkeypatch.setenv(ahead.ENV, "0")
    assert ahead.overlap_refused(Outcome(device="cpu", peak_rss=1 << 30)) == \
        f"{ahead.ENV}=0"
    assert ahead.early_overlap_refused(str(AMP)) == f"{ahead.ENV}=0"


def test_the_first_two_runs_overlap_only_where_the_script_cannot_collide(tmp_path, monkeypatch):
    """Before any run has said where it trains: not a script that forms a process group or
    builds a DeepSpeed engine (a port each, a compiled op), nor on a machine with a GPU."""
    from ampdoctor.script import ahead

    monkeypatch.delenv(ahead.ENV, raising=False)
    monkeypatch.setattr(ahead, "_cores", lambda: 2)
    monkeypatch.setattr(ahead, "_available_memory", lambda: 8 << 30)
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n")
    grouped = tmp_path / "grouped.py"
    grouped.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    engine = tmp_path / "engine.py"
    engine.write_text("import deepspeed\nengine, *_ = deepspeed.initialize(model=m)\n")
    import torch
    gpu = torch.backends.cuda.is_built() and any(
        os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd"))
    assert ahead.early_overlap_refused(str(plain)) == ("a GPU on this machine" if gpu else None)
    assert ahead.early_overlap_refused(str(grouped)) == "the script may form a process group"
    assert ahead.early_overlap_refused(str(engine)) == "the script may form a process group"


@pytest.mark.slow
def test_the_reference_of_a_run_started_ahead_is_started_ahead_too(tmp_path):
    """Once a precision's run started ahead has ended (and the reference's windows are known),
    its reference run -- teacher-forced to that run's weights -- is queued ahead of the rest
    (`ScriptSession.follow_ups`); the ladder, asking for the run, reads that very reference
    (the same weights, one reference run, none run again)."""
    from ampdoctor.script import spawn
    from ampdoctor.script.command import Command
    from ampdoctor.script.session import ScriptSession

    if _overlap_refused(AMP) is not None:
        pytest.skip(f"runs do not overlap here: {_overlap_refused(AMP)}")
    command = Command(str(AMP), ["--amp", "--accum-steps", "4", "--batch-size", "8"],
                      ["--amp", "--accum-steps", "1", "--batch-size", "32"], steps=3,
                      cwd=str(tmp_path), output_dir=str(tmp_path))
    ss = ScriptSession(command)
    ss.plan = lambda session: ["fp16"]
    try:
        ss.start()
        queued = "reference of the fp16 run"
        deadline = time.monotonic() + 120
        while queued not in ss.runs.ahead.queue and time.monotonic() < deadline:
            for run in ss.runs.ahead.in_flight():
                run.collect(0.1)
            ss.follow_ups()
        assert queued in ss.runs.ahead.queue
        job = ss.runs.ahead.queue[queued].job
        read = len(ss.outputs)
        trace = ss.trace("fp16")
        # the queued reference was the one read: taken from the queue, for the run's weights
        assert queued not in ss.runs.ahead.queue
        states = [s for s, _ in ss.teacher_states(trace)]
        assert job.teacher is not None and len(job.teacher) == len(states) == 3
        assert all(a is b for a, b in zip(job.teacher, states, strict=True))
        assert [o["run"] for o in ss.outputs[read:]] == ["fp16 run", "reference run"]
        assert all(ss._refs.get((id(s), w)) for w, s in enumerate(states))
    finally:
        spawn.stop_all()
