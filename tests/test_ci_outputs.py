"""`diagnose --strict`, `--junit FILE`, `--sarif FILE`: what a CI system reads.

`--strict` makes a warning fail the run (exit 1; the record says `strict`, its `exit_code` and a
note); JUnit has one test case per rung (failure for `fail`, skipped for `skip`/`not-run`);
SARIF has one result per finding at the user's file:line."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ampdoctor import record as records
from ampdoctor.cli.ci_reports import junit_xml, sarif_json
from conftest import CONFIGS, RECIPES, ROOT, marked_line, run_cli


def _cases(path: Path) -> dict[str, ET.Element]:
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    [suite] = list(root)
    return {case.get("name", ""): case for case in suite.iter("testcase")}


def _one_child(case: ET.Element) -> str | None:
    children = [c.tag for c in case if c.tag in ("failure", "skipped", "error")]
    assert len(children) <= 1
    return children[0] if children else None


# -- end to end ----------------------------------------------------------------------------------

@pytest.mark.xdist_group("broken_bf16_scaler_on")
def test_strict_fails_a_run_with_a_warning_and_writes_both_reports(tmp_path, diagnosed):
    plain = diagnosed("broken_bf16_scaler_on")
    assert plain.returncode == 0 and plain.record["verdict"] == "healthy"
    assert "strict" not in plain.record

    junit, sarif = tmp_path / "ampdoctor.xml", tmp_path / "ampdoctor.sarif"
    run = run_cli("diagnose", CONFIGS / "broken_bf16_scaler_on.yaml", "--strict", "--json",
                  "--out", tmp_path / "runs", "--junit", junit, "--sarif", sarif, cwd=ROOT)
    assert run.returncode == 1, run.stderr
    record = run.record
    assert record["verdict"] == "healthy" and record["strict"] is True
    assert record["exit_code"] == 1
    assert record["notes"][0] == "--strict: 1 warning(s) (half-open-amp) fail this run: exit 1"
    # the saved record says the same, and `report --record-exit-code` agrees
    [saved] = (tmp_path / "runs").glob("*.json")
    assert json.loads(saved.read_text())["exit_code"] == 1
    assert run_cli("report", saved, "--record-exit-code").returncode == 1
    assert "note: --strict: 1 warning(s)" in run_cli("report", saved).stdout

    cases = _cases(junit)
    assert list(cases) == [r["id"] for r in record["rungs"]]
    statuses = {r["id"]: r["status"] for r in record["rungs"]}
    assert statuses["bf16-no-scaler"] == "warn"
    failure = cases["bf16-no-scaler"].find("failure")
    assert failure is not None and failure.get("type") == "half-open-amp"
    line = marked_line(RECIPES / "broken_bf16_scaler_on.py", "half-open-amp")
    assert f"broken_bf16_scaler_on.py:{line}" in (failure.text or "")
    for rung, status in statuses.items():
        expected = {"pass": None, "warn": "failure", "skip": "skipped"}[status]
        assert _one_child(cases[rung]) == expected, rung

    data = json.loads(sarif.read_text())
    assert data["version"] == "2.1.0"
    [result] = data["runs"][0]["results"]
    assert result["ruleId"] == "half-open-amp" and result["level"] == "warning"
    physical = result["locations"][0]["physicalLocation"]
    assert physical["artifactLocation"] == {"uri": "recipes/broken_bf16_scaler_on.py",
                                            "uriBaseId": "%SRCROOT%"}
    assert physical["region"]["startLine"] == line
    assert data["runs"][0]["invocations"][0]["exitCode"] == 1


@pytest.mark.xdist_group("broken_clip_before_unscale")
def test_a_failed_rung_is_a_junit_failure_and_a_sarif_error(tmp_path):
    junit, sarif = tmp_path / "out.xml", tmp_path / "out.sarif"
    run = run_cli("diagnose", CONFIGS / "broken_clip_before_unscale.yaml", "--out",
                  tmp_path / "runs", "--junit", junit, "--sarif", sarif, cwd=ROOT)
    assert run.returncode == 1, run.stderr
    assert "junit report written to" in run.stderr and "sarif report written to" in run.stderr
    cases = _cases(junit)
    failure = cases["fp16-scaler"].find("failure")
    assert failure is not None and failure.get("type") == "clip-before-unscale"
    line = marked_line(RECIPES / "broken_clip_before_unscale.py", "clip-before-unscale")
    assert f"broken_clip_before_unscale.py:{line}" in (failure.text or "")
    for rung in ("double-scaling", "clip-space", "skips", "ddp-sync"):
        skipped = cases[rung].find("skipped")
        assert skipped is not None and skipped.get("message", "").startswith("not-run:"), rung
    assert _one_child(cases["reproducibility"]) is None
    root = ET.parse(junit).getroot()
    assert root.get("failures") == "1" and root.get("tests") == str(len(cases))

    results = json.loads(sarif.read_text())["runs"][0]["results"]
    errors = [r for r in results if r["level"] == "error"]
    assert [r["ruleId"] for r in errors] == ["clip-before-unscale"]
    physical = errors[0]["locations"][0]["physicalLocation"]
    assert physical["artifactLocation"]["uri"] == "recipes/broken_clip_before_unscale.py"
    assert physical["region"]["startLine"] == line


def test_strict_leaves_a_clean_run_at_exit_0(tmp_path):
    run = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--strict", "--json", "--rungs",
                  "reproducibility,fp32-accum", "--out", tmp_path / "runs")
    assert run.returncode == 0, run.stderr
    assert run.record["strict"] is True and run.record["exit_code"] == 0
    assert not any(n.startswith("--strict") for n in run.record["notes"])


def test_a_report_file_in_a_missing_folder_is_a_usage_error_before_the_run(tmp_path):
    run = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--junit",
                  tmp_path / "nowhere" / "out.xml", "--out", tmp_path / "runs")
    assert run.returncode == 2
    said = " ".join(run.stderr.split())         # the terminal may wrap a long path
    assert "usage error: --junit" in said and "does not exist" in said
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*.json"))


# -- the writers on hand-made records ------------------------------------------------------------

def test_strict_exit_code_of_a_record():
    healthy = {"verdict": "healthy", "findings": [], "rungs": [{"id": "skips", "status": "pass"}]}
    warned = dict(healthy, findings=[{"severity": "warning", "kind": "frequent-skips"}])
    assert records.exit_code(warned) == 0
    assert records.exit_code(dict(warned, strict=True)) == 1
    assert records.exit_code(dict(healthy, strict=True)) == 0
    warn_rung = dict(healthy, strict=True, rungs=[{"id": "skips", "status": "warn"}])
    assert records.exit_code(warn_rung) == 1
    assert records.exit_code({"verdict": "failed", "strict": True}) == 1


def test_junit_of_a_run_that_never_started_and_hostile_text_is_valid_xml(tmp_path):
    record = {"name": "evil\x1b[31m\x00", "verdict": "error", "exit_code": 3, "rungs": [],
              "findings": [], "error": {"type": "UserCodeError",
                                        "message": "boom \x07\x1b]8;;x\x1b\\ at train.py:3"}}
    path = tmp_path / "j.xml"
    path.write_text(junit_xml(record))
    root = ET.parse(path).getroot()        # parses: no raw control character
    case = root.find("testsuite/testcase")
    assert case is not None and case.get("name") == "setup"
    error = case.find("error")
    assert error is not None and "at train.py:3" in (error.text or "")
    assert root.get("errors") == "1" and root.get("tests") == "1"
    assert "\x1b" not in path.read_text() and "\x00" not in path.read_text()


def test_sarif_location_relative_to_the_spec_and_no_nan(tmp_path):
    spec = tmp_path / "proj" / "triage.yaml"
    record = {"spec": str(spec), "verdict": "failed", "exit_code": 1, "findings": [
        {"rung": "fp32-accum", "kind": "missing-accumulation-average", "severity": "error",
         "title": "t", "message": "m", "evidence": {"measured": float("inf")},
         "location": {"file": "train.py", "line": 12}},
        {"rung": "skips", "kind": "frequent-skips", "severity": "warning", "title": "t",
         "message": "m", "evidence": {}}]}
    data = json.loads(sarif_json(record, base=str(tmp_path)))
    first, second = data["runs"][0]["results"]
    assert first["level"] == "error" and second["level"] == "warning"
    physical = first["locations"][0]["physicalLocation"]
    assert physical["artifactLocation"]["uri"] == "proj/train.py"
    assert physical["region"]["startLine"] == 12
    assert first["properties"]["evidence"]["measured"] == "inf"
    assert "locations" not in second
    rules = [r["id"] for r in data["runs"][0]["tool"]["driver"]["rules"]]
    assert rules[first["ruleIndex"]] == "missing-accumulation-average"
    assert rules[second["ruleIndex"]] == "frequent-skips"
