"""The run cannot hang the command or outlive its report, and stdout belongs to ampdoctor.

A CLI diagnose runs the user's loop in a child process watched by the command
(supervise/__init__.py):
a loop that ignores SIGALRM, swallows the stop with a bare `except:`, hangs while its module is
imported, starts a thread that never ends, kills its own process, or writes to fd 1 / closes
`sys.stdout` still gives a record, the right exit code, and a command that ends. Each case runs
the real console script in a process of its own, bounded by the test's own timeout, so a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run_cli, run_cli_process

HEADER = '''
import os
import signal
import sys
import threading
import time

import torch


def make():
    return torch.nn.Linear(4, 1)


def data():
    return torch.randn(16, 4), torch.randn(16, 1)


def step(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) / K
        scaler.scale(loss).backward()
        yield i
        if (i + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
'''

LOOPS = {
    # SIGALRM ignored, then a loop that never ends
    "ignores_sigalrm": '''
def train_loop(model, optimizer, micro_batches, run):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    for i in step(model, optimizer, micro_batches, run):
        while run.precision == "bf16" and i == 1:
            time.sleep(0.01)  # HANG
''',
    # its own SIGALRM handler (a library's progress timer) replaces ampdoctor's
    "replaces_sigalrm": '''
def train_loop(model, optimizer, micro_batches, run):
    signal.signal(signal.SIGALRM, lambda *a: None)
    for i in step(model, optimizer, micro_batches, run):
        while run.precision == "bf16" and i == 1:
            time.sleep(0.01)  # HANG
''',
    # every stop swallowed
    "bare_except": '''
def train_loop(model, optimizer, micro_batches, run):
    for i in step(model, optimizer, micro_batches, run):
        while run.precision == "bf16" and i == 1:
            try:
                time.sleep(0.01)  # HANG
            except:  # noqa: E722
                pass
''',
}


def _project(tmp_path: Path, loop: str, timeout_s: float = 20, module_tail: str = "") -> Path:
    (tmp_path / "u.py").write_text(HEADER + textwrap.dedent(loop) + module_tail)
    spec = tmp_path / "spec.yaml"
    spec.write_text("project_root: .\nmodel: u:make\ndata: u:data\ntrain_loop: u:train_loop\n"
                    "accumulation_steps: 2\nmicro_batch_size: 4\noptimizer_steps: 2\n"
                    f"device: cpu\ntimeout_s: {timeout_s}\nprecisions: [fp32, bf16]\n")
    return spec


def _line(tmp_path: Path, marker: str) -> int:
    text = (tmp_path / "u.py").read_text().splitlines()
    return next(n for n, t in enumerate(text, start=1) if marker in t)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_loop_that_will_not_stop_is_killed_at_the_bound_with_a_record(tmp_path, loop):
    from ampdoctor import supervise

    timeout_s = 20   # room for the rungs before the hang on a loaded machine
    spec = _project(tmp_path, LOOPS[loop], timeout_s)
    started = time.monotonic()
    result = run_cli_process("diagnose", spec, "--json", "--out", tmp_path / "runs",
                             timeout=600)
    elapsed = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    record = result.record
    assert record["exit_code"] == 3
    assert (record["verdict"], record["failed_rung"]) == ("error", "bf16-no-scaler")
    statuses = {r["id"]: r["status"] for r in record["rungs"]}
    assert statuses["fp32-accum"] == "pass" and statuses["bf16-no-scaler"] == "fail"
    assert statuses["fp16-scaler"] == "not-run"
    finding = next(f for f in record["findings"] if f["rung"] == "bf16-no-scaler")
    assert finding["kind"] == "loop-error"
    assert "did not stop" in finding["message"]
    assert finding["evidence"]["timeout_s"] == timeout_s
    # where it hung: the user's line, read from the stacks of the process before it was killed
    assert finding["location"]["file"].endswith("u.py")
    assert finding["location"]["line"] == _line(tmp_path, "# HANG")
    bound = timeout_s + supervise.GRACE_S
    assert finding["evidence"]["killed_after_s"] >= bound - 0.5
    assert elapsed >= bound
    saved = list((tmp_path / "runs").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["failed_rung"] == "bf16-no-scaler"


def test_a_module_that_hangs_while_imported_is_stopped_with_a_record(tmp_path):
    tail = ('\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n'
            'while True:\n    time.sleep(0.01)  # HANG AT IMPORT\n')
    loop = "def train_loop(model, optimizer, micro_batches, run):\n    pass\n"
    spec = _project(tmp_path, loop, timeout_s=2, module_tail=tail)
    result = run_cli_process("diagnose", spec, "--json", "--out", tmp_path / "runs",
                             timeout=300)
    assert result.returncode == 3, result.stderr
    error = result.record["error"]
    assert "Loading the spec's code" in error["message"] and "did not finish" in error["message"]
    assert error["location"]["line"] == _line(tmp_path, "# HANG AT IMPORT")
    assert result.record["rungs"] == []


def test_a_thread_the_loop_never_ends_does_not_keep_the_command_alive(tmp_path):
    loop = '''
    def train_loop(model, optimizer, micro_batches, run):
        threading.Thread(target=lambda: time.sleep(3600), daemon=False).start()
        for _ in step(model, optimizer, micro_batches, run):
            pass
    '''
    spec = _project(tmp_path, loop)
    started = time.monotonic()
    result = run_cli_process("diagnose", spec, "--out", tmp_path / "runs", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "HEALTHY" in result.stdout
    assert time.monotonic() - started < 250


def test_a_loop_that_kills_its_own_process_gives_a_record(tmp_path):
    loop = '''
    def train_loop(model, optimizer, micro_batches, run):
        for i in step(model, optimizer, micro_batches, run):
            if run.precision == "bf16":
                os.kill(os.getpid(), signal.SIGKILL)
    '''
    spec = _project(tmp_path, loop)
    result = run_cli_process("diagnose", spec, "--json", "--out", tmp_path / "runs",
                             timeout=300)
    assert result.returncode == 3, result.stderr
    record = result.record
    assert record["failed_rung"] == "bf16-no-scaler"
    finding = record["findings"][-1]
    assert finding["kind"] == "loop-error"
    assert "was killed by SIGKILL during the bf16-no-scaler rung" in finding["message"]
    assert [r["id"] for r in record["rungs"][:3]] == ["reproducibility", "fp32-accum",
                                                       "bf16-no-scaler"]


WRITES = '''
def train_loop(model, optimizer, micro_batches, run):
    if not sys.stdout.closed:
        print("a print from the loop")
        sys.stdout.close()
    os.write(1, b"raw bytes on fd 1 {not json\\n")
    for _ in step(model, optimizer, micro_batches, run):
        pass
'''


def test_with_json_stdout_is_one_document_whatever_the_loop_writes(tmp_path):
    spec = _project(tmp_path, WRITES)
    result = run_cli_process("diagnose", spec, "--json", "--verbose", "--out",
                             tmp_path / "runs", timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)            # the whole of stdout, one document
    assert record["verdict"] == "healthy" and record["exit_code"] == 0
    # --verbose: the loop's output is shown as it comes, on stderr
    assert "raw bytes on fd 1 {not json" in result.stderr
    assert "a print from the loop" in result.stderr


def test_the_loops_output_is_kept_in_the_record_not_shown(tmp_path):
    spec = _project(tmp_path, WRITES)
    result = run_cli_process("diagnose", spec, "--json", "--out", tmp_path / "runs",
                             timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert "a print from the loop" not in result.stderr
    assert "raw bytes on fd 1 {not json" not in result.stderr
    kept = "".join(o["text"] for o in record["output"])
    assert "a print from the loop" in kept and "raw bytes on fd 1 {not json" in kept


def test_a_loop_that_closes_stdout_still_gets_its_report(tmp_path):
    spec = _project(tmp_path, WRITES)
    result = run_cli("diagnose", spec, "--out", tmp_path / "runs")
    assert result.returncode == 0, result.stderr
    assert "HEALTHY" in result.stdout
    assert "raw bytes on fd 1" not in result.stdout
