"""Script mode on a script written for torchrun (recipes/scripts/ddp_torchrun.py: the DDP
tutorial's `init_process_group` from the launcher's environment, LOCAL_RANK read from it, DDP
with `no_sync` over the window). Plainly, without a launcher, it fails on the missing RANK; in a
diagnose each run forms a group of one, as `torchrun --nproc_per_node 1` would, and the record
says so at the script's line. Under a launcher of several ranks a diagnose is refused (exit 2):
every rank would start one whose runs wait for ranks that never come."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RECIPES, assert_undivided_loss, run_cli

SCRIPT = RECIPES / "scripts" / "ddp_torchrun.py"
pytestmark = pytest.mark.xdist_group("script_mode")


def diagnose(tmp_path: Path, *args: str, env: dict | None = None):
    return run_cli("diagnose", SCRIPT, "--json", "--out", tmp_path / "runs", "--steps", "3",
                   "--", *args, env=env)


def _line(needle: str) -> int:
    return next(n for n, text in enumerate(SCRIPT.read_text().splitlines(), start=1)
                if needle in text)


def test_plainly_the_script_needs_a_launcher():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    plain = subprocess.run([sys.executable, str(SCRIPT), "--epochs", "1"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0 and "RANK" in plain.stderr


def test_healthy_without_a_launcher_each_run_forms_a_group_of_one(tmp_path):
    result = diagnose(tmp_path)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    rungs = {r["id"]: r for r in record["rungs"]}
    assert rungs["fp32-accum"]["status"] == "pass"
    assert rungs["fp32-accum"]["details"]["steps_compared"] == 3
    assert rungs["bf16-no-scaler"]["status"] == "pass"
    assert rungs["ddp-sync"]["status"] == "skip"
    note = next(n for n in record["notes"] if "group of one" in n)
    assert f"ddp_torchrun.py:{_line('init_process_group(backend')}" in note
    assert "RANK=0, WORLD_SIZE=1" in note


def test_loss_not_divided_is_named_at_its_backward(tmp_path):
    result = diagnose(tmp_path, "--bug", "no-divide")
    assert_undivided_loss(result, SCRIPT)


def test_under_a_launcher_of_two_ranks_it_is_refused(tmp_path):
    result = diagnose(tmp_path, env={"WORLD_SIZE": "2", "RANK": "0"})
    assert result.returncode == 2
    assert "WORLD_SIZE=2" in result.stderr and "without the launcher" in result.stderr
