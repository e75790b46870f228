"""Records that are hostile to read (issue 35): `report` on a record with a huge integer, deep
nesting or odd types exits 2 naming what is wrong, in every output mode, never a traceback."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

MODES = ([], ["--json"], ["--html", "-o", "page.html"], ["--record-exit-code"])


def _report(tmp_path, text: str, extra: list[str]):
    path = tmp_path / "r.json"
    path.write_text(text)
    args = [a if a != "page.html" else str(tmp_path / a) for a in extra]
    result = run_cli("report", path, *args)
    return result, " ".join(result.stderr.split())


@pytest.mark.parametrize("extra", MODES)
def test_an_integer_of_5000_digits_is_exit_2(tmp_path, extra):
    text = '{"verdict": "failed", "rungs": [], "junk": ' + "9" * 5000 + "}"
    result, said = _report(tmp_path, text, extra)
    assert result.returncode == 2, said
    assert "an integer too long to read (over the interpreter's 4,300-digit limit)" in said
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("extra", MODES)
@pytest.mark.parametrize("record, field, digits", [
    ({"verdict": "error", "exit_code": 10 ** 299}, "exit_code", 300),
    ({"verdict": "healthy", "record_version": -(10 ** 399)}, "record_version", 400),
    ({"verdict": "failed", "findings": [{"rung": "fp32-accum", "kind": "gradient-mismatch",
                                         "severity": "error", "message": "m",
                                         "evidence": {"measured": 10 ** 40}}]},
     "findings.0.evidence.measured", 41),
])
def test_a_huge_integer_is_exit_2_naming_its_field(tmp_path, extra, record, field, digits):
    result, said = _report(tmp_path, json.dumps(record), extra)
    assert result.returncode == 2, said
    assert f"field '{field}' holds an integer of {digits} digits" in said
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("extra", MODES)
def test_nesting_past_the_bound_is_exit_2_naming_the_field(tmp_path, extra):
    # 40 levels: parsed fine by json, deeper than any record ampdoctor writes
    text = '{"verdict": "failed", "details": ' + "[" * 40 + "]" * 40 + "}"
    result, said = _report(tmp_path, text, extra)
    assert result.returncode == 2, said
    assert "field 'details" in said and "nested over 32 levels deep" in said
    assert "Traceback" not in result.stderr


def test_a_big_but_plausible_integer_still_renders(tmp_path):
    record = {"verdict": "failed", "rungs": [], "findings": [], "peak_bytes": 2 ** 40}
    result, said = _report(tmp_path, json.dumps(record), [])
    assert result.returncode == 0, said
