"""`ampdoctor export-test`: a diagnosis becomes a pytest file that fails on the broken tree,
naming the kind and the line, and passes once the bug is fixed (issue 37, part 1).

Each round trip copies a broken recipe into a project of its own (tmp_path), diagnoses it with
the real CLI, exports the test, runs it with pytest in a fresh process (the plugin is the
installed one), fixes the copied file the way a user would, and runs it again.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ampdoctor.runner import export_test
from conftest import CONFIGS, RECIPES, marked_line, run_cli_process


def _pytest(test_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(test_file)], cwd=test_file.parent.parent, capture_output=True,
                          text=True, timeout=600)


def _project(tmp_path: Path, files: list[str], config: str) -> Path:
    """A project of the user's: the recipe files and the spec, with tests/."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    for name in files:
        target = project / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RECIPES / name, target)
    text = (CONFIGS / config).read_text()
    root = "../../recipes" if "/" in config else "../recipes"
    text = text.replace(f"project_root: {root}", "project_root: .")
    text = text.replace(f"paths: [{root}/", "paths: [")
    (project / "triage.yaml").write_text(text)
    return project


def _round_trip(project: Path, diagnose_args: list[str], bug_file: Path, bug: str, fix: str,
                kind: str, line: int) -> Path:
    out = project / ".ampdoctor" / "runs"
    proc = run_cli_process("diagnose", "--out", str(out), *diagnose_args, cwd=project)
    assert proc.returncode == 1, proc.stderr
    proc = run_cli_process("export-test", "--out", str(out), cwd=project)
    assert proc.returncode == 0, proc.stderr
    written = list((project / "tests").glob("test_ampdoctor_*.py"))
    assert len(written) == 1, written
    test_file = written[0]
    text = test_file.read_text()
    assert f'kinds=["{kind}"]' in text
    assert "/tmp" not in text.split('"""')[2]        # paths relative to the test file
    broken = _pytest(test_file)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert f"error: {kind}" in broken.stdout
    assert f"{bug_file.resolve()}:{line}" in broken.stdout
    source = bug_file.read_text()
    assert bug in source
    bug_file.write_text(source.replace(bug, fix))
    fixed = _pytest(test_file)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "1 passed" in fixed.stdout
    return test_file


def test_a_spec_record_round_trips(tmp_path):
    project = _project(tmp_path, ["broken_missing_average.py", "common.py"],
                       "broken_missing_average.yaml")
    test_file = _round_trip(
        project, ["triage.yaml"], project / "broken_missing_average.py",
        "loss = criterion(pred.float(), y)\n", "loss = criterion(pred.float(), y) / accum\n",
        "missing-accumulation-average", 22)
    text = test_file.read_text()
    assert 'spec=HERE / "../triage.yaml"' in text
    assert 'rungs=["reproducibility", "fp32-accum"]' in text
    assert "broken_missing_average.py:22 (rung fp32-accum)" in " ".join(text.split())


def test_an_entry_point_record_round_trips(tmp_path):
    pytest.importorskip("transformers")
    project = _project(tmp_path, ["frameworks/entry_points.py", "common.py"],
                       "frameworks/broken_hf_trainer_key_sum.yaml")
    _round_trip(project, ["triage.yaml"], project / "frameworks" / "entry_points.py",
                'F.mse_loss(outputs, y, reduction="sum")', "F.mse_loss(outputs, y)",
                "reduction-mismatch", 31)


def test_a_script_record_round_trips(tmp_path):
    """Script mode: the script, its args, the reference's args and its working directory."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    script = project / "train.py"
    shutil.copy(RECIPES / "scripts" / "amp_recipe.py", script)
    test_file = _round_trip(
        project, ["train.py", "--reference-args", "--accum-steps 1 --batch-size 32", "--",
                  "--accum-steps", "4", "--batch-size", "8", "--bug", "no-average"],
        script, 'if args.bug != "no-average":', "if True:",
        "missing-accumulation-average", 48)
    text = test_file.read_text()
    assert 'script=HERE / "../train.py"' in text
    assert 'args=["--accum-steps", "4", "--batch-size", "8", "--bug", "no-average"]' in text
    assert 'reference_args=["--accum-steps", "1", "--batch-size", "32"],  # given' in text
    assert 'cwd=HERE / ".."' in text


def test_a_script_record_whose_reference_read_a_config_copy_round_trips(tmp_path):
    """The reference inferred as a copy of the script's YAML config (gone once the diagnose
    ended): the exported test infers it again instead of naming the copy."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "configs").mkdir()
    script = project / "train.py"
    shutil.copy(RECIPES / "scripts" / "yaml_config.py", script)
    shutil.copy(RECIPES / "scripts" / "configs" / "finetune.yaml", project / "configs")
    test_file = _round_trip(
        project, ["train.py", "--", "--config", "configs/finetune.yaml", "--bug", "no-divide"],
        script, 'if args.bug != "no-divide":', "if True:", "missing-accumulation-average",
        marked_line(script, "missing-accumulation-average"))
    text = test_file.read_text()
    assert "reference_args=" not in text and "inferred again" in text
    assert 'args=["--config", "configs/finetune.yaml", "--bug", "no-divide"]' in text


# ------------------------------------------------------------------------------ the parts
def _record(**fields):
    base = {"name": "run", "spec": "/p/triage.yaml", "verdict": "healthy", "findings": [],
            "rungs": [{"id": "reproducibility", "status": "pass"},
                      {"id": "fp32-accum", "status": "pass"},
                      {"id": "bf16-no-scaler", "status": "skip",
                       "summary": "bf16 is not in the spec's precisions (fp32): ..."},
                      {"id": "fp16-scaler", "status": "skip",
                       "summary": "not among the rungs asked for (fp32-accum)"},
                      {"id": "skips", "status": "skip", "summary": "no scaler to skip with"},
                      {"id": "ddp-sync", "status": "not-run",
                       "summary": "an earlier rung failed"}]}
    base.update(fields)
    return base


def test_the_rungs_are_those_that_ran_and_the_kinds_those_that_failed():
    record = _record(verdict="failed", findings=[
        {"kind": "clip-before-unscale", "severity": "error", "rung": "fp32-accum"},
        {"kind": "frequent-skips", "severity": "warning", "rung": "skips"},
        {"kind": "clip-before-unscale", "severity": "error", "rung": "clip-space"}])
    assert export_test.rung_ids(record) == ["reproducibility", "fp32-accum", "skips"]
    assert export_test.guarded_kinds(record) == ["clip-before-unscale"]
    assert export_test.guarded_kinds(_record(findings=record["findings"])) == []


@pytest.mark.parametrize(("verdict", "findings", "why"), [
    ("healthy", [], None),
    ("healthy", [{"kind": "frequent-skips", "severity": "warning"}], None),
    ("healthy", [{"kind": "clip-before-unscale", "severity": "warning"}], "is back"),
    ("failed", [{"kind": "missing-zero-grad", "severity": "error"}], "not fixed"),
    ("inconclusive", [], "compared nothing"),
    ("error", [], "could not run"),
])
def test_a_fixed_tree_is_healthy_without_the_guarded_kinds(verdict, findings, why):
    got = export_test.judge_guard({"verdict": verdict, "findings": findings},
                                  ["clip-before-unscale"])
    assert (got is None) if why is None else (why in got)


def test_the_written_file_is_python_that_names_its_guard(tmp_path):
    record = _record(verdict="failed", name="my run", findings=[
        {"kind": "double-average", "severity": "error", "rung": "fp32-accum",
         "message": 'consumed 0.25x """ the reference', "location": {"file": "/p/train.py",
                                                                     "line": 7}}])
    target = tmp_path / "tests" / "test_x.py"
    text = export_test.render(record, Path("/r/rec.json"), target, steps=2)
    compile(text, str(target), "exec")
    assert "def test_my_run_keeps_double_average_fixed(ampdoctor):" in text
    assert 'kinds=["double-average"]' in text and "steps=2," in text
    assert "double-average at /p/train.py:7 (rung fp32-accum)" in " ".join(text.split())
    assert 'rungs=["reproducibility", "fp32-accum", "skips"]' in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_export_refuses_what_it_cannot_rerun_and_never_overwrites(tmp_path):
    record = tmp_path / "rec.json"
    record.write_text(json.dumps(_record(spec=None)))
    proc = run_cli_process("export-test", str(record), "-o", str(tmp_path / "t.py"))
    assert proc.returncode == 2
    assert "names neither a spec file nor a script" in proc.stderr
    assert not (tmp_path / "t.py").exists()
    record.write_text(json.dumps(_record()))
    (tmp_path / "t.py").write_text("mine\n")
    proc = run_cli_process("export-test", str(record), "-o", str(tmp_path / "t.py"))
    assert proc.returncode == 2 and "exists" in proc.stderr
    assert (tmp_path / "t.py").read_text() == "mine\n"
    proc = run_cli_process("export-test", str(record), "-o", str(tmp_path / "t.py"),
                           "--force")
    assert proc.returncode == 0, proc.stderr
    assert "def test_run_stays_healthy(ampdoctor):" in (tmp_path / "t.py").read_text()
    proc = run_cli_process("export-test", str(tmp_path / "nope.json"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
