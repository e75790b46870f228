"""Script mode on a script that compiles its model (recipes/scripts/compiled_model.py): every
run leaves `torch.compile` eager (each run is a new process and would compile anew: minutes on a
CPU for one diagnose), says so in the record's notes with the line that compiled, and judges the
updates as for the eager model: healthy clean, the loss not divided by K named at its line with
its factor."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RECIPES, marked_line, run_cli

SCRIPT = RECIPES / "scripts" / "compiled_model.py"
pytestmark = pytest.mark.xdist_group("script_mode")


def diagnose(tmp_path: Path, *args: str):
    return run_cli("diagnose", SCRIPT, "--json", "--out", tmp_path / "runs", "--steps", "3",
                   "--", *args)


def compile_note(record: dict) -> str:
    notes = [n for n in record["notes"] if n.startswith("torch.compile")]
    assert len(notes) == 1, record["notes"]
    return notes[0]


def test_a_compiled_healthy_script_passes_eager_and_says_so(tmp_path):
    result = diagnose(tmp_path, "--amp")
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy" and result.record["findings"] == []
    fp32 = next(r for r in result.record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["status"] == "pass" and fp32["details"]["steps_compared"] == 3
    line = next(n for n, text in enumerate(SCRIPT.read_text().splitlines(), start=1)
                if "torch.compile(net)" in text)
    assert f"compiled_model.py:{line}" in compile_note(result.record)


def test_a_compiled_script_without_the_average_is_named_at_its_line(tmp_path):
    result = diagnose(tmp_path, "--bug", "no-average")
    assert result.returncode == 1, result.stderr
    errors = [f for f in result.record["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["missing-accumulation-average"]
    finding = errors[0]
    assert finding["rung"] == "fp32-accum"
    assert finding["location"]["line"] == marked_line(SCRIPT, "missing-accumulation-average")
    assert finding["evidence"]["measured"] == pytest.approx(4, rel=0.02)
    compile_note(result.record)
