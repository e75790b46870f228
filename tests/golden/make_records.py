"""Produce the run records that tests/test_golden.py renders: each one `ampdoctor diagnose SPEC
--json` with the real CLI (a child process, torch needed), then normalised so that running this
again on any machine gives the same files, byte for byte, as far as the diagnosis itself is the
same (the numbers a run measures are kept as measured).

    PYTHONPATH=$PWD python tests/golden/make_records.py            # from the repository root

This is not run by the tests: the records are committed, and the tests only re-render them
(no torch, no diagnose). Run it when the record format changes on purpose, then regenerate the
renderings (`AMPDOCTOR_UPDATE_GOLDEN=1 pytest tests/test_golden.py`) and review both diffs.

What is normalised, and why:
- absolute paths (the checkout, the hostile spec's temporary folder) become relative ones
  (`recipes/x.py`, `project/hostile_loop.py`): the terminal report shows a relative path as it
  is whatever the working directory, and the HTML page shows the record's path;
- durations (each rung's and the run's seconds): 1.0 for a rung that ran, 0.0 for one that did
  not; the environment (date, host, python, platform, torch, git commit) and the ampdoctor
  version: fixed placeholders.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parent
ROOT = GOLDEN.parents[1]

#: golden name -> the sample config it is diagnosed from (None: the hostile spec below)
RECORDS: dict[str, str | None] = {
    # healthy, every rung passes or is skipped for want of a setting: "No finding"
    "healthy": "healthy_sgd",
    # fails at fp32-accum with numbers and the user's file:line (the loss is not divided by K)
    "failed_missing_average": "broken_missing_average",
    # healthy with a warning and a skipped rung (no fp16 update to compare), and a note
    "skipped_and_warning": "broken_scale_never_settles",
    # exit 3: the loop raised (loop-error), with its traceback
    "loop_error": "broken_loop_error",
    # exit 3 too, every user text hostile: the spec's name, the exception message (ESC, OSC,
    # C1, CR, NUL, bidi override, HTML, newlines, cut for length), the source line
    "hostile_text": None,
}

HOSTILE_LOOP = '''"""A loop whose error message is hostile text: terminal escapes, a bidi
override, HTML, and far more text than a message may keep."""

import torch.nn as nn

HOSTILE = ("\\x1b[31mRED\\x1b[0m \\x1b]0;pwned\\x07 "
           "\\x1b]8;;https://evil.example/\\x1b\\\\click\\x1b]8;;\\x1b\\\\ "
           "\\x9b31mC1 all good\\rEVIL a\\x00b abc\\u202edef <script>alert(1)</script> "
           "caf\\u00e9 \\u65e5\\u672c\\u8a9e\\nsecond line\\t(tab)\\n")


def train_loop(model, optimizer, micro_batches, run):
    for x, y in micro_batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        raise RuntimeError(HOSTILE + "very long " * 600)  # BUG: loop-error \u202e gnp.exe \x1b[2J
'''

HOSTILE_SPEC = r'''# Hostile user text: the name, the loop's error message, its source line.
name: "hostile \e[31mred\e[0m \u202eevil txt.exe \e]0;title\a"
project_root: .
model: common:make_mlp
data: common:make_regression_data
loss: common:mse_loss
train_loop: hostile_loop:train_loop
accumulation_steps: 4
micro_batch_size: 8
optimizer_steps: 3
device: cpu
seed: 0
'''

ENVIRONMENT = {"date": "2000-01-01T00:00:00+00:00", "host": "golden-host", "python": "3.X",
               "platform": "Linux", "torch": "2.X+cpu", "git_commit": "0" * 40}
VERSION = "0.0.0+golden"


def _relative(value: Any, prefixes: dict[str, str]) -> Any:
    """Every string of the record with the absolute prefixes replaced."""
    if isinstance(value, str):
        for prefix, replacement in prefixes.items():
            value = value.replace(prefix, replacement)
        return value
    if isinstance(value, list):
        return [_relative(v, prefixes) for v in value]
    if isinstance(value, dict):
        return {k: _relative(v, prefixes) for k, v in value.items()}
    return value


def normalise(record: dict[str, Any], prefixes: dict[str, str]) -> dict[str, Any]:
    record = _relative(record, prefixes)
    record["ampdoctor_version"] = VERSION
    for rung in record.get("rungs") or []:
        rung["seconds"] = 0.0 if rung.get("status") == "not-run" else 1.0
    record["seconds"] = sum(r["seconds"] for r in record.get("rungs") or [])
    env = record.get("environment") or {}
    env.update({k: v for k, v in ENVIRONMENT.items() if k in env})
    return record


def diagnose(spec: Path, out: Path) -> dict[str, Any]:
    env = dict(os.environ, NO_COLOR="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "ampdoctor", "diagnose", str(spec), "--json",
                           "--out", str(out)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    if proc.returncode not in (0, 1, 3):
        raise SystemExit(f"ampdoctor diagnose {spec} exited {proc.returncode}:\n{proc.stderr}")
    return json.loads(proc.stdout)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp).resolve()
        project = work / "project"
        project.mkdir()
        shutil.copy(ROOT / "recipes" / "common.py", project / "common.py")
        (project / "hostile_loop.py").write_text(HOSTILE_LOOP)
        (project / "hostile.yaml").write_text(HOSTILE_SPEC)
        # the longest prefix first: the temporary folder may lie under the checkout
        prefixes = dict(sorted({str(work) + os.sep: "", str(ROOT) + os.sep: ""}.items(),
                               key=lambda item: -len(item[0])))
        for name, config in RECORDS.items():
            spec = (ROOT / "sample_configs" / f"{config}.yaml" if config
                    else project / "hostile.yaml")
            record = normalise(diagnose(spec, work / "runs"), prefixes)
            target = GOLDEN / f"{name}.record.json"
            # ASCII only: the committed file shows a bidi override or a C1 control as an escape
            target.write_text(json.dumps(record, indent=2, ensure_ascii=True) + "\n")
            print(f"{target.relative_to(ROOT)}: {record['verdict']}, exit {record['exit_code']}")


if __name__ == "__main__":
    main()
