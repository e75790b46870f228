"""--keep-going: every rung runs after a failure, each later one marked; the verdict, the exit
code and failed_rung stay the first failure's."""

from __future__ import annotations

from pathlib import Path

from conftest import CONFIGS, run_cli


def test_keep_going_runs_every_rung_after_the_first_failure(tmp_path: Path):
    plain = run_cli("diagnose", CONFIGS / "broken_missing_average.yaml", "--json",
                    "--out", tmp_path / "plain", "--rungs", "fp32-accum,bf16-no-scaler,skips")
    assert [r["status"] for r in plain.record["rungs"] if r["id"] == "bf16-no-scaler"] == \
        ["not-run"]
    result = run_cli("diagnose", CONFIGS / "broken_missing_average.yaml", "--json", "--keep-going",
                     "--out", tmp_path / "kept", "--rungs", "fp32-accum,bf16-no-scaler,skips")
    record = result.record
    assert result.returncode == 1 == record["exit_code"] == plain.returncode
    assert record["verdict"] == "failed" and record["failed_rung"] == "fp32-accum"
    assert record["keep_going"] is True
    rungs = {r["id"]: r for r in record["rungs"]}
    assert "after_failure" not in rungs["fp32-accum"]
    # the bf16 run has the same missing average: it fails too, and says it came after
    bf16 = rungs["bf16-no-scaler"]
    assert bf16["status"] == "fail" and bf16["after_failure"] is True
    assert bf16["summary"].startswith("after a failure: missing-accumulation-average")
    assert rungs["skips"]["status"] == "pass" and rungs["skips"]["after_failure"] is True
    # a rung the spec leaves out is still a skip, after the failure
    assert rungs["fp16-scaler"]["status"] == "skip"
    kinds = [(f["rung"], f["kind"], f.get("after_failure", False)) for f in record["findings"]]
    assert kinds == [("fp32-accum", "missing-accumulation-average", False),
                     ("bf16-no-scaler", "missing-accumulation-average", True)]
    assert "after a failure" in run_cli("report", next((tmp_path / "kept").glob("*.json"))).stdout


def test_a_later_loop_error_does_not_change_the_first_failures_verdict():
    from ampdoctor import record as records
    from ampdoctor.core.findings import Finding, RungResult
    from ampdoctor.ladder import after_failure
    from ampdoctor.record.model import RecordModel
    from ampdoctor.runner import fill_record

    first = RungResult("fp32-accum", "fail", "missing-accumulation-average: ...", [
        Finding("fp32-accum", "missing-accumulation-average", "error", "4x")])
    later = after_failure(RungResult("bf16-no-scaler", "fail", "the bf16 loop raised", [
        Finding("bf16-no-scaler", "loop-error", "error", "raised")]))
    record = RecordModel(verdict="error")
    fill_record(record, [first, later])
    assert record.verdict == "failed" and record.failed_rung == "fp32-accum"
    assert records.exit_code(record) == 1          # not 3: the loop error came after
    assert record.findings[1].after_failure is True
    # without the first failure, the loop error decides
    alone = RecordModel(verdict="error")
    fill_record(alone, [RungResult("bf16-no-scaler", "fail", "raised", [
        Finding("bf16-no-scaler", "loop-error", "error", "raised")])])
    assert alone.verdict == "error" and records.exit_code(alone) == 3
