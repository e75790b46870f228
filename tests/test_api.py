"""The Python API as users call it: `ampdoctor.diagnose()` on a YAML path or on a `Spec` built
in code with callables, from a script; overrides; the typed record; `assert_healthy`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CONFIGS, ROOT, marked_line
from user_code import FACTORIES, loop

USER_MODULE = (FACTORIES + loop("healthy_loop")
               + loop("unaveraged_loop", divide=False,
                      marker="# BUG: missing-accumulation-average"))

SCRIPT = textwrap.dedent('''\
    import json, sys
    import ampdoctor
    from userloop import make_model, make_data, healthy_loop, unaveraged_loop

    out = {}
    for name, loop in (("healthy", healthy_loop), ("broken", unaveraged_loop)):
        spec = ampdoctor.Spec(model=make_model, data=make_data, train_loop=loop,
                              accumulation_steps=4, micro_batch_size=8, device="cpu",
                              optimizer={"name": "SGD", "lr": 0.05})
        record = ampdoctor.diagnose(spec, out=sys.argv[1])
        first = record.errors[0] if record.errors else None
        out[name] = {"verdict": record.verdict, "exit_code": record.exit_code,
                     "failed_rung": record.failed_rung, "path": str(record.path),
                     "kind": first and first.kind,
                     "measured": first and first.evidence.get("measured"),
                     "file": first and first.location.file,
                     "line": first and first.location.line,
                     "finding_type": type(first).__name__ if first else None}
    print(json.dumps(out))
    ''')


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    (tmp_path / "userloop.py").write_text(USER_MODULE)
    (tmp_path / "check.py").write_text(SCRIPT)
    return tmp_path


def test_api_from_a_script_with_a_spec_built_in_code(user_project: Path, tmp_path: Path) -> None:
    records = tmp_path / "records"
    proc = subprocess.run([sys.executable, "check.py", str(records)], cwd=user_project,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["healthy"]["verdict"] == "healthy" and out["healthy"]["exit_code"] == 0
    broken = out["broken"]
    assert broken["verdict"] == "failed" and broken["exit_code"] == 1
    assert broken["failed_rung"] == "fp32-accum"
    assert broken["kind"] == "missing-accumulation-average"
    assert broken["measured"] == pytest.approx(4.0, rel=0.02)     # K = 4 times too large
    assert Path(broken["file"]).name == "userloop.py"
    assert broken["line"] == marked_line(user_project / "userloop.py",
                                         "missing-accumulation-average")
    assert broken["finding_type"] == "FindingModel"
    saved = json.loads(Path(broken["path"]).read_text())
    assert saved["verdict"] == "failed"
    # a spec built in code keeps its keys, callables by name, in the record's environment
    assert "userloop:unaveraged_loop" in saved["environment"]["spec_text"]


def test_diagnose_a_yaml_path_with_overrides(tmp_path: Path) -> None:
    import ampdoctor

    record = ampdoctor.diagnose(CONFIGS / "broken_missing_average.yaml", out=tmp_path,
                                steps=2, rungs=["fp32-accum", "fp16-scaler"])
    assert record.path is not None and record.path.parent == tmp_path
    statuses = {r.id: r.status for r in record.rungs}
    assert statuses["fp32-accum"] == "fail"
    assert statuses["reproducibility"] == "skip"
    assert record.data["optimizer_steps"] == 2
    finding = record.errors[0]
    assert (finding.kind, finding.rung) == ("missing-accumulation-average", "fp32-accum")
    assert finding.location.line == marked_line(ROOT / "recipes" / "broken_missing_average.py",
                                                "missing-accumulation-average")
    assert "missing-accumulation-average" in record.summary()
    assert f"broken_missing_average.py:{finding.location.line}" in record.summary()


def test_rungs_not_asked_for_are_skipped_with_the_reason(tmp_path: Path) -> None:
    import ampdoctor

    record = ampdoctor.diagnose(CONFIGS / "healthy_sgd.yaml", save=False,
                                rungs=["fp32-accum"], precisions=["fp32", "bf16"])
    assert record.healthy and record.path is None
    rungs = {r.id: r for r in record.rungs}
    assert rungs["fp32-accum"].status == "pass"
    assert rungs["bf16-no-scaler"].status == "skip"
    assert "not among the rungs asked for (fp32-accum)" in rungs["bf16-no-scaler"].summary


def test_bad_overrides_and_specs_raise_spec_error() -> None:
    import ampdoctor

    with pytest.raises(ampdoctor.SpecError, match="optimizer_steps"):
        ampdoctor.load(CONFIGS / "healthy_sgd.yaml", steps=0)
    with pytest.raises(ampdoctor.SpecError, match="not a rung.*Did you mean 'fp32-accum'"):
        ampdoctor.load(CONFIGS / "healthy_sgd.yaml", rungs=["fp32-acum"])
    with pytest.raises(ampdoctor.SpecError, match="unknown override.*warmup"):
        ampdoctor.load(CONFIGS / "healthy_sgd.yaml", warmup=3)
    with pytest.raises(ampdoctor.SpecError, match="does not exist"):
        ampdoctor.diagnose("no/such/spec.yaml")
    with pytest.raises(ampdoctor.SpecError, match="takes a Spec or the path"):
        ampdoctor.diagnose(42)


def test_ddp_with_a_callable_the_ranks_cannot_import_is_a_spec_error() -> None:
    import ampdoctor

    def local_loop(model, optimizer, micro_batches, run):
        pass

    spec = ampdoctor.Spec(model="common:make_mlp", data="common:make_regression_data",
                          train_loop=local_loop, accumulation_steps=4, micro_batch_size=8,
                          ddp={"world_size": 2})
    with pytest.raises(ampdoctor.SpecError, match="import the spec's code by name"):
        ampdoctor.diagnose(spec, save=False)


def test_assert_healthy_passes_a_healthy_loop_and_fails_with_the_diagnosis() -> None:
    import ampdoctor

    record = ampdoctor.assert_healthy(CONFIGS / "healthy_sgd.yaml", rungs=["fp32-accum"])
    assert record.healthy
    with pytest.raises(AssertionError) as info:
        ampdoctor.assert_healthy(CONFIGS / "broken_missing_average.yaml", rungs=["fp32-accum"])
    text = str(info.value)
    assert "FAILED at rung fp32-accum" in text
    assert "missing-accumulation-average [fp32-accum]" in text
    line = marked_line(ROOT / "recipes" / "broken_missing_average.py",
                       "missing-accumulation-average")
    assert f"broken_missing_average.py:{line}" in text
    assert "fix: " in text and "measured=4" in text
    assert isinstance(info.value, ampdoctor.Unhealthy)
    assert info.value.record.failed_rung == "fp32-accum"


def test_user_code_failure_is_a_record_with_the_traceback(tmp_path: Path) -> None:
    import ampdoctor

    def broken_data():
        raise ValueError("no shards found")

    spec = ampdoctor.Spec(model="common:make_mlp", data=broken_data,
                          train_loop="healthy_sgd:train_loop", accumulation_steps=4,
                          micro_batch_size=8, project_root=str(ROOT / "recipes"))
    record = ampdoctor.diagnose(spec, save=False)
    assert record.verdict == "error" and record.exit_code == 3
    assert "no shards found" in record.data["error"]["message"]
    assert record.data["error"]["location"]["file"] == __file__
    assert 'raise ValueError("no shards found")' in record.data["error"]["traceback"]
    assert isinstance(record.exception, ampdoctor.UserCodeError)


def test_api_import_stays_light() -> None:
    code = ("import sys, ampdoctor; assert 'torch' not in sys.modules; "
            "ampdoctor.Spec; ampdoctor.load; assert 'torch' not in sys.modules, 'torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (ROOT / "ampdoctor" / "py.typed").exists()
