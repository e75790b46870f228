"""`ampdoctor scan` never blocks on a file that is not a regular file: a FIFO (named pipe) on the
command line, inside a folder it walks, or in a spec's `scan.paths` (the double-scaling rung) is
skipped and said so, never opened for a read that would wait for a writer forever.

Every scan here runs in a process of its own with a timeout: a regression fails the test
(subprocess.TimeoutExpired) instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import unquote

import pytest

from conftest import ROOT, run_cli_process

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")

#: Seconds a scan of a handful of files may take before it counts as blocked.
TIMEOUT = 60

GRADSCALER = textwrap.dedent("""\
    import torch
    scaler = torch.amp.GradScaler("cuda")
    def step(model, loss, opt):
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    """)
#: Two owners on one path: exit 1.
DOUBLE = GRADSCALER.replace("scaler.scale(loss)", "scaler.scale(loss * 1024)")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _skip_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "not a regular file (FIFO)" in line]


@pytest.mark.parametrize("name", ["pipe.py", "pipe.json", "pipe.yaml", "pipe.sh", "pipe"])
def test_a_fifo_on_the_command_line_is_skipped_not_read(tmp_path, name):
    fifo = _fifo(tmp_path / name)
    result = run_cli_process("scan", fifo, cwd=tmp_path, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr     # nothing found
    lines = _skip_lines(result.stdout)
    assert len(lines) == 1 and name in lines[0], result.stdout
    assert "Traceback" not in result.stderr


def test_a_fifo_inside_a_walked_folder_is_skipped_and_the_rest_is_scanned(tmp_path):
    (tmp_path / "sub").mkdir()
    _fifo(tmp_path / "sub" / "ds_config.json")
    _fifo(tmp_path / "train_pipe.py")
    (tmp_path / "train.py").write_text(DOUBLE)
    result = run_cli_process("scan", tmp_path, cwd=tmp_path, timeout=TIMEOUT)
    # the regular file is still read: its two owners make exit 1
    assert result.returncode == 1, result.stdout + result.stderr
    assert "train.py:4" in result.stdout
    lines = _skip_lines(result.stdout)
    assert sorted(Path(line.split(":")[0].strip()).name for line in lines) == \
        ["ds_config.json", "train_pipe.py"], result.stdout
    assert "1 file(s) searched" in result.stdout and "2 skipped" in result.stdout


def test_a_fifo_given_twice_is_one_skip(tmp_path):
    fifo = _fifo(tmp_path / "pipe.py")
    result = run_cli_process("scan", fifo, tmp_path, "--json", cwd=tmp_path, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["skipped"] == [{"file": str(fifo), "reason": "not a regular file (FIFO)",
                                  "file_type": "FIFO"}]


def test_the_json_and_sarif_reports_name_the_skipped_fifo(tmp_path):
    fifo = _fifo(tmp_path / "pipe.yaml")
    (tmp_path / "train.py").write_text(GRADSCALER)
    result = run_cli_process("scan", tmp_path, "--json", cwd=tmp_path, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["files_scanned"] == 1 and len(report["owners"]) == 1
    assert {"file": str(fifo), "reason": "not a regular file (FIFO)", "file_type": "FIFO"} \
        in report["skipped"]

    result = run_cli_process("scan", tmp_path, "--format", "sarif", cwd=tmp_path,
                             timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)["runs"][0]
    notes = run["invocations"][0]["toolExecutionNotifications"]
    skipped = [n for n in notes if "not a regular file (FIFO)" in n["message"]["text"]]
    assert len(skipped) == 1
    artifact = skipped[0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert unquote(artifact["uri"]) == "pipe.yaml" and artifact["uriBaseId"] == "%SRCROOT%"
    assert run["results"] == []


def test_a_symlink_to_a_fifo_is_skipped_a_symlink_to_a_file_is_read(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "train.py").write_text(DOUBLE)
    fifo = _fifo(real / "pipe.py")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "linked_train.py").symlink_to(real / "train.py")
    (tree / "linked_pipe.py").symlink_to(fifo)
    result = run_cli_process("scan", tree, cwd=tmp_path, timeout=TIMEOUT)
    assert result.returncode == 1, result.stdout + result.stderr   # the linked file's 2 owners
    assert "linked_train.py:4" in result.stdout
    lines = _skip_lines(result.stdout)
    assert len(lines) == 1 and "linked_pipe.py" in lines[0], result.stdout


def test_a_missing_path_is_still_exit_2_next_to_a_fifo(tmp_path):
    fifo = _fifo(tmp_path / "pipe.py")
    result = run_cli_process("scan", fifo, tmp_path / "nope", cwd=tmp_path, timeout=TIMEOUT)
    assert result.returncode == 2
    assert "does not exist" in result.stderr and result.stdout == ""


def test_the_double_scaling_rung_skips_a_fifo_in_scan_paths(tmp_path):
    """The rung of `ampdoctor diagnose` calls the scan on the spec's `scan.paths`."""
    fifo = _fifo(tmp_path / "pipe.json")
    (tmp_path / "train.py").write_text(GRADSCALER)
    _fifo(tmp_path / "other_pipe.py")
    code = textwrap.dedent(f"""\
        import json, sys
        from ampdoctor.ladder.double_scaling import evaluate
        result = evaluate({[str(fifo), str(tmp_path)]!r})
        json.dump({{"status": result.status, "summary": result.summary,
                    "skipped": result.details["skipped"]}}, sys.stdout)
        """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          cwd=ROOT, timeout=TIMEOUT * 3)       # (it imports torch)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["status"] == "pass"
    assert "one loss-scale owner: GradScaler at" in out["summary"]
    assert "(2 file(s) skipped)" in out["summary"]
    assert sorted((Path(s["file"]).name, s["reason"]) for s in out["skipped"]) == [
        ("other_pipe.py", "not a regular file (FIFO)"),
        ("pipe.json", "not a regular file (FIFO)")]


def test_scan_paths_itself_never_opens_a_fifo(tmp_path):
    """The library call, in-process but guarded: a FIFO that got opened for reading would
    block; here the reader side has no writer, so a blocking open would hang the child."""
    _fifo(tmp_path / "a.py")
    code = ("import sys; from ampdoctor.scan import scan_paths; "
            f"r = scan_paths([{str(tmp_path)!r}, {str(tmp_path / 'a.py')!r}]); "
            "print(r.files_scanned, r.skipped); "
            "assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          cwd=ROOT, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert "not a regular file (FIFO)" in proc.stdout and proc.stdout.startswith("0 ")
