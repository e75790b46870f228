"""Output that is not a terminal (a pipe, a CI log): tables at a readable width (COLUMNS when
set, else 100 columns), and a path or a number never cut in the middle."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli

GOLDEN = Path(__file__).parent / "golden"

#: a path as long as a line holds, in the finding's "at" line
LONG_PATH = "/home/someone/projects/a-rather-long-project-name/src/training/loops/train_amp.py"
#: one as long as the summary column holds at 80 columns
SUMMARY_PATH = "/srv/proj/src/loops/amp_train_step.py"
LONG_NUMBER = "1.23456789012345e-05"


def _record(tmp_path: Path) -> Path:
    record = json.loads((GOLDEN / "failed_missing_average.record.json").read_text())
    record["rungs"][1]["summary"] = (f"the step at {SUMMARY_PATH}:123 applied {LONG_NUMBER}x the "
                                     "reference update, which is far outside the tolerance band")
    record["findings"][0]["location"]["file"] = LONG_PATH
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    return path


def _lines(text: str) -> list[str]:
    return text.splitlines()


def test_piped_output_is_100_columns_unless_columns_says(tmp_path: Path):
    record = _record(tmp_path)
    default = run_cli("report", record, env={"COLUMNS": ""})
    assert default.returncode == 0, default.stderr
    assert max(len(line) for line in _lines(default.stdout)) == 100
    wide = run_cli("report", record, env={"COLUMNS": "120"})
    assert max(len(line) for line in _lines(wide.stdout)) == 120
    # a COLUMNS too narrow for a table is not honoured
    narrow = run_cli("report", record, env={"COLUMNS": "20"})
    assert max(len(line) for line in _lines(narrow.stdout)) == 100


def test_a_path_or_a_number_is_never_cut(tmp_path: Path):
    record = _record(tmp_path)
    for columns in ("", "80", "120"):
        out = run_cli("report", record, env={"COLUMNS": columns}).stdout
        # whole on one line of the table, and in the finding's "at" line
        assert f"{SUMMARY_PATH}:123" in out, out
        assert LONG_NUMBER in out
        if columns != "80":     # (at 80 columns the line itself is shorter than this path)
            assert f"{LONG_PATH}:22" in out


def test_the_records_path_on_stderr_is_one_line(tmp_path: Path):
    out = tmp_path / ("a-folder-with-a-long-name-" * 3) / "runs"
    result = run_cli("diagnose", GOLDEN.parent.parent / "sample_configs" / "healthy_sgd.yaml",
                     "--rungs", "fp32-accum", "--out", out, env={"COLUMNS": ""})
    assert result.returncode == 0, result.stderr
    saved = next(line for line in _lines(result.stderr) if line.startswith("record saved to"))
    assert str(out) in saved
