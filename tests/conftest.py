"""Shared helpers: run the installed CLI, find the line a recipe marks as the bug."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
CONFIGS = ROOT / "sample_configs"


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


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None,
            timeout: float = 300) -> CliResult:
    full_env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    full_env.update(env or {})
    proc = subprocess.run(ampdoctor_command() + [str(a) for a in args], capture_output=True,
                          text=True, cwd=cwd, env=full_env, timeout=timeout)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def marked_line(path: Path, kind: str) -> int:
    """The line of `path` that carries `# BUG: <kind>`."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if re.search(rf"# BUG: {re.escape(kind)}\b", line):
            return number
    raise AssertionError(f"{path} has no '# BUG: {kind}' marker")


@pytest.fixture
def records_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"
