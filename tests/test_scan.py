"""The static double-scaling search over the recipes: owners, verdicts, the rung, the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampdoctor.core.findings import RungResult
from ampdoctor.kinds import CATALOGUE
from ampdoctor.ladder.double_scaling import evaluate
from ampdoctor.scan import ScanPathError, scan_paths
from ampdoctor.scan.command import run_scan

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes" / "double_scaling"


def line_of(path: Path, marker: str) -> int:
    """The 1-based line of the only line of `path` that contains `marker`."""
    hits = [i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text]
    assert len(hits) == 1, f"marker {marker!r} must appear once in {path}, found {hits}"
    return hits[0]


def owner(kind: str, case: str, file: str, marker: str, key_path: str | None = None) -> tuple:
    path = RECIPES / case / file
    return (kind, str(path), line_of(path, marker), key_path)


# case -> (severity, expected owners as (kind, absolute file, line, key_path))
DOUBLE_SCALED = {
    "deepspeed_plus_gradscaler": (
        "error",
        [
            owner("GradScaler", "deepspeed_plus_gradscaler", "train.py", "MARK-GRADSCALER"),
            owner("DeepSpeed fp16", "deepspeed_plus_gradscaler", "ds_config.json",
                  '"enabled": true', "fp16.enabled"),
        ],
    ),
    "trainer_fp16_plus_gradscaler": (
        "error",
        [
            owner("GradScaler", "trainer_fp16_plus_gradscaler", "train.py", "MARK-GRADSCALER"),
            owner("Trainer fp16", "trainer_fp16_plus_gradscaler", "train.py", "MARK-TRAINER-FP16"),
        ],
    ),
    "accelerate_fp16_plus_gradscaler": (
        "error",
        [
            owner("GradScaler", "accelerate_fp16_plus_gradscaler", "train.py", "MARK-GRADSCALER"),
            owner("accelerate fp16", "accelerate_fp16_plus_gradscaler", "accelerate_config.yaml",
                  "mixed_precision: fp16", "mixed_precision"),
        ],
    ),
    "lightning_16mixed_plus_gradscaler": (
        "error",
        [
            owner("GradScaler", "lightning_16mixed_plus_gradscaler", "model.py", "MARK-GRADSCALER"),
            owner("Lightning 16-mixed", "lightning_16mixed_plus_gradscaler", "train.py",
                  "MARK-LIGHTNING"),
        ],
    ),
    "lightning_cli_yaml_plus_gradscaler": (
        "error",
        [
            owner("GradScaler", "lightning_cli_yaml_plus_gradscaler", "model.py",
                  "MARK-GRADSCALER"),
            owner("Lightning 16-mixed", "lightning_cli_yaml_plus_gradscaler", "config.yaml",
                  "precision: 16-mixed", "trainer.precision"),
        ],
    ),
    "static_loss_scale_plus_gradscaler": (
        "error",
        [
            owner("GradScaler", "static_loss_scale_plus_gradscaler", "train.py", "MARK-GRADSCALER"),
            owner("static loss scale", "static_loss_scale_plus_gradscaler", "train.py",
                  "MARK-STATIC"),
        ],
    ),
    "separate_entry_points": (
        "warning",
        [
            owner("Trainer fp16", "separate_entry_points", "finetune_hf.py", "MARK-TRAINER-FP16"),
            owner("GradScaler", "separate_entry_points", "train_amp.py", "MARK-GRADSCALER"),
        ],
    ),
}

# case -> expected owners (at most one) and kinds that must be reported as information
CLEAN = {
    "clean_gradscaler_only": (
        [owner("GradScaler", "clean_gradscaler_only", "train.py", "MARK-GRADSCALER")],
        [],
    ),
    "clean_deepspeed_bf16": ([], ["DeepSpeed bf16", "GradScaler (disabled)", "DeepSpeed engine"]),
    "clean_trainer_fp16": (
        [owner("Trainer fp16", "clean_trainer_fp16", "train.py", "MARK-TRAINER-FP16")],
        [],
    ),
}


def _owner_tuples(owners) -> list[tuple]:
    out = []
    for o in owners:
        d = o if isinstance(o, dict) else o.to_dict()
        out.append((d["kind"], d["file"], d["line"], d["key_path"]))
    return sorted(out)


def test_every_recipe_folder_is_covered():
    folders = {p.name for p in RECIPES.iterdir() if p.is_dir()}
    assert folders == set(DOUBLE_SCALED) | set(CLEAN) | {"raises_on_import"}


@pytest.mark.parametrize("case", sorted(DOUBLE_SCALED))
def test_double_scaled_recipe_names_both_owners(case):
    severity, expected = DOUBLE_SCALED[case]
    report = scan_paths([RECIPES / case])
    assert report.skipped == []
    assert _owner_tuples(report.owners) == sorted(expected)
    assert len(report.findings) == 1
    finding = report.findings[0]
    assert finding.rung == "double-scaling" and finding.kind == "double-scaling"
    assert finding.severity == severity
    assert finding.title == CATALOGUE["double-scaling"].title and finding.fix
    assert finding.evidence["measured"] == 2 and finding.evidence["expected"] == 1
    assert _owner_tuples(finding.evidence["owners"]) == sorted(expected)
    # the finding points at the owner to remove: a static scale, else a hand-written
    # GradScaler (the framework owns the loop it runs), else the first owner
    owners = finding.evidence["owners"]
    rank = {"static loss scale": 0, "GradScaler": 1}
    target = min(owners, key=lambda o: (rank.get(o["kind"], 2), owners.index(o)))
    assert (finding.location.file, finding.location.line) == (target["file"], target["line"])
    assert finding.location.file.endswith(".py")
    for _kind, file, line, key in expected:
        assert f"{Path(file).name}:{line}" in finding.message
        if key:
            assert f"({key})" in finding.message
    assert report.status == ("fail" if severity == "error" else "warn")
    assert report.exit_code == 1


@pytest.mark.parametrize("case", sorted(CLEAN))
def test_clean_recipe_has_no_finding(case):
    expected, info_kinds = CLEAN[case]
    report = scan_paths([RECIPES / case])
    assert report.findings == []
    assert report.exit_code == 0 and report.status == "pass"
    assert _owner_tuples(report.owners) == sorted(expected)
    kinds = {s.kind for s in report.infos}
    for kind in info_kinds:
        assert kind in kinds


def test_clean_deepspeed_bf16_reports_the_bf16_key_and_the_disabled_scaler():
    case = RECIPES / "clean_deepspeed_bf16"
    report = scan_paths([case])
    infos = {(s.kind, s.file, s.line, s.key_path) for s in report.infos}
    assert ("DeepSpeed bf16", str(case / "ds_config.json"),
            line_of(case / "ds_config.json", '"enabled": true'), "bf16.enabled") in infos
    assert ("GradScaler (disabled)", str(case / "train.py"),
            line_of(case / "train.py", "MARK-GRADSCALER"), None) in infos


@pytest.mark.parametrize("case", sorted(DOUBLE_SCALED))
def test_rung_reports_the_same_owners(case):
    severity, expected = DOUBLE_SCALED[case]
    result = evaluate([RECIPES / case], None)
    assert isinstance(result, RungResult)
    assert result.id == "double-scaling"
    assert result.status == ("fail" if severity == "error" else "warn")
    assert _owner_tuples(result.details["owners"]) == sorted(expected)
    assert result.details["files_scanned"] >= 1 and result.details["skipped"] == []
    for kind, file, line, _key in expected:
        assert f"{kind} at {Path(file).name}:{line}" in result.summary
    assert [f.kind for f in result.findings] == ["double-scaling"]


@pytest.mark.parametrize("case", sorted(CLEAN))
def test_rung_passes_clean_recipes(case):
    expected, _ = CLEAN[case]
    result = evaluate([RECIPES / case], None)
    assert result.status == "pass" and result.findings == []
    if expected:
        kind, file, line, _key = expected[0]
        assert result.summary == f"one loss-scale owner: {kind} at {Path(file).name}:{line}"
    else:
        assert result.summary.startswith("no loss-scale owner")


def test_rung_merges_the_runtime_owner_with_the_static_one():
    case = RECIPES / "deepspeed_plus_gradscaler"
    line = line_of(case / "train.py", "MARK-GRADSCALER")
    runtime = {"kind": "GradScaler", "file": str(case / "train.py"), "line": line}
    result = evaluate([case], runtime)
    assert result.status == "fail"
    owners = result.details["owners"]
    assert len(owners) == 2  # merged, not a third owner
    used = [o for o in owners if o.get("runtime")]
    assert [(o["file"], o["line"]) for o in used] == [(str(case / "train.py"), line)]
    assert result.details["runtime_owner"] == runtime
    assert f"the fp16 run used GradScaler at train.py:{line}" in result.summary


def test_rung_clean_with_runtime_owner_says_which_one_ran():
    case = RECIPES / "clean_gradscaler_only"
    line = line_of(case / "train.py", "MARK-GRADSCALER")
    result = evaluate([case], {"kind": "GradScaler", "file": str(case / "train.py"), "line": line})
    assert result.status == "pass"
    assert result.summary == (
        f"one loss-scale owner: GradScaler at train.py:{line} (the one the fp16 run used)"
    )


def test_rung_runtime_owner_outside_the_scan_is_still_an_owner(tmp_path):
    case = RECIPES / "clean_trainer_fp16"
    loop = tmp_path / "loop.py"
    loop.write_text("def loop():\n    pass\n")
    result = evaluate([case], {"kind": "GradScaler", "file": str(loop), "line": 2})
    # the run used a GradScaler that no scanned file links to the Trainer: separate entry points
    assert result.status == "warn"
    kinds = sorted(o["kind"] for o in result.details["owners"])
    assert kinds == ["GradScaler", "Trainer fp16"]


def test_rung_with_missing_scan_path_skips_it():
    result = evaluate([RECIPES / "clean_gradscaler_only", RECIPES / "no-such-folder"], None)
    assert result.status == "pass"
    missing = {"file": str(RECIPES / "no-such-folder"), "reason": "does not exist"}
    assert missing in result.details["skipped"]


# -- the command -------------------------------------------------------------------------------

def test_run_scan_exit_codes(capsys):
    assert run_scan([str(RECIPES / "clean_gradscaler_only")], as_json=False) == 0
    out = capsys.readouterr().out
    line = line_of(RECIPES / "clean_gradscaler_only" / "train.py", "MARK-GRADSCALER")
    assert f"train.py:{line}" in out
    assert run_scan([str(RECIPES / "deepspeed_plus_gradscaler")], as_json=False) == 1
    out = capsys.readouterr().out
    case = RECIPES / "deepspeed_plus_gradscaler"
    assert f"train.py:{line_of(case / 'train.py', 'MARK-GRADSCALER')}" in out
    ds_line = line_of(case / "ds_config.json", chr(34) + "enabled" + chr(34) + ": true")
    assert f"ds_config.json:{ds_line}" in out
    assert "double-scaling" in out
    assert run_scan([str(RECIPES / "separate_entry_points")], as_json=False) == 1
    capsys.readouterr()
    assert run_scan([str(RECIPES / "does-not-exist")], as_json=False) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "does not exist" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert run_scan([str(RECIPES / "clean_trainer_fp16")], as_json=False, fmt="xml") == 2


def test_scan_paths_raises_file_not_found_for_a_missing_path():
    with pytest.raises(FileNotFoundError) as info:
        scan_paths([RECIPES / "nope"])
    assert isinstance(info.value, ScanPathError)


def test_json_output_is_the_report_and_nothing_else(capsys):
    case = RECIPES / "deepspeed_plus_gradscaler"
    code = run_scan([str(case)], as_json=True)
    assert code == 1
    data = json.loads(capsys.readouterr().out)
    assert data["command"] == "scan" and data["verdict"] == "fail" and data["exit_code"] == 1
    assert data["files_scanned"] == 3
    assert _owner_tuples(data["owners"]) == sorted(DOUBLE_SCALED["deepspeed_plus_gradscaler"][1])
    assert [f["kind"] for f in data["findings"]] == ["double-scaling"]
    finding = data["findings"][0]
    assert finding["severity"] == "error" and finding["rung"] == "double-scaling"
    assert finding["location"] == {"file": str(case / "train.py"),
                                   "line": line_of(case / "train.py", "MARK-GRADSCALER")}
    assert finding["evidence"]["measured"] == 2 and finding["evidence"]["expected"] == 1
    assert data["groups"][0]["entry"] == str(case / "launch.py")
    assert {i["kind"] for i in data["infos"]} == {"DeepSpeed engine"}
    # --format json is the same as --json
    assert run_scan([str(case)], as_json=False, fmt="json") == 1
    assert json.loads(capsys.readouterr().out)["owners"] == data["owners"]


def test_sarif_output(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    case = RECIPES / "accelerate_fp16_plus_gradscaler"
    assert run_scan([str(case)], as_json=False, fmt="sarif") == 1
    sarif = json.loads(capsys.readouterr().out)
    assert sarif["version"] == "2.1.0" and "sarif-2.1.0" in sarif["$schema"]
    run = sarif["runs"][0]
    assert run["tool"]["driver"]["name"] == "ampdoctor"
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == ["double-scaling"]
    assert len(run["results"]) == 1
    result = run["results"][0]
    assert result["ruleId"] == "double-scaling" and result["level"] == "error"
    physical = result["locations"][0]["physicalLocation"]
    assert physical["artifactLocation"]["uri"] == (
        "recipes/double_scaling/accelerate_fp16_plus_gradscaler/train.py")
    assert physical["artifactLocation"]["uriBaseId"] == "%SRCROOT%"
    assert physical["region"]["startLine"] == line_of(case / "train.py", "MARK-GRADSCALER")
    related = {(r["physicalLocation"]["artifactLocation"]["uri"].rsplit("/", 1)[-1],
                r["physicalLocation"]["region"]["startLine"]) for r in result["relatedLocations"]}
    assert related == {
        ("train.py", line_of(case / "train.py", "MARK-GRADSCALER")),
        ("accelerate_config.yaml",
         line_of(case / "accelerate_config.yaml", "mixed_precision: fp16")),
    }
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == REPO.as_uri() + "/"


def test_sarif_for_a_clean_tree_has_no_results(capsys):
    assert run_scan([str(RECIPES / "clean_trainer_fp16")], fmt="sarif") == 0
    sarif = json.loads(capsys.readouterr().out)
    assert sarif["runs"][0]["results"] == []


def test_warning_in_sarif_is_a_warning(capsys):
    assert run_scan([str(RECIPES / "separate_entry_points")], fmt="sarif") == 1
    result = json.loads(capsys.readouterr().out)["runs"][0]["results"][0]
    assert result["level"] == "warning" and result["ruleId"] == "double-scaling"


@pytest.mark.parametrize("fmt", ["text", "json", "sarif"])
def test_output_file(tmp_path, capsys, fmt):
    target = tmp_path / f"scan.{fmt}"
    code = run_scan([str(RECIPES / "trainer_fp16_plus_gradscaler")], fmt=fmt, output=str(target))
    assert code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "wrote" in captured.err
    text = target.read_text()
    line = line_of(RECIPES / "trainer_fp16_plus_gradscaler" / "train.py", "MARK-TRAINER-FP16")
    if fmt == "text":
        assert f"train.py:{line}" in text and "\x1b[" not in text
    else:
        json.loads(text)


def test_module_entry_point_never_imports_torch():
    code = (
        "import sys\n"
        "from ampdoctor.scan.command import main\n"
        f"rc = main([{str(RECIPES)!r}, '--json'])\n"
        "assert 'torch' not in sys.modules, 'the scan imported torch'\n"
        "sys.stderr.write('RC=%d' % rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "RC=1" in proc.stderr
    data = json.loads(proc.stdout)
    assert data["verdict"] == "fail"


def test_python_dash_m_scan_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ampdoctor.scan.command", str(RECIPES / "clean_trainer_fp16"),
         "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "pass"
    proc = subprocess.run(
        [sys.executable, "-m", "ampdoctor.scan.command", str(tmp_path / "missing")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr and proc.stdout == ""


# -- never executes the scanned code ---------------------------------------------------------

def test_scan_never_executes_user_code():
    case = RECIPES / "raises_on_import"
    marker = case / "EXECUTED.marker"
    assert not marker.exists()
    report = scan_paths([case])
    assert not marker.exists()
    assert _owner_tuples(report.owners) == [
        ("GradScaler", str(case / "train.py"), line_of(case / "train.py", "MARK-GRADSCALER"), None)
    ]
    proc = subprocess.run([sys.executable, "-m", "ampdoctor.scan.command", str(case)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "executed!" not in proc.stdout + proc.stderr
    assert not marker.exists()


# -- the real CLI (`ampdoctor scan`) ------------------------------------------------------------



def _cli(*args: str, cwd: Path = REPO):
    """`ampdoctor scan ARGS` in this process (returncode, stdout, stderr); the console script
    and `python -m` in processes of their own are tested above and below."""
    from conftest import run_cli
    return run_cli("scan", *args, cwd=cwd)


@pytest.mark.parametrize("case", sorted(DOUBLE_SCALED))
def test_cli_scan_finds_double_scaling(case):
    proc = _cli(str(RECIPES / case))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for _kind, file, line, _key in DOUBLE_SCALED[case][1]:
        assert f"{Path(file).name}:{line}" in proc.stdout


@pytest.mark.parametrize("case", sorted(CLEAN))
def test_cli_scan_clean(case):
    proc = _cli(str(RECIPES / case), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["findings"] == []


def test_cli_scan_missing_path_and_sarif():
    proc = _cli(str(RECIPES / "nope"))
    assert proc.returncode == 2 and proc.stdout == ""
    proc = _cli(str(RECIPES / "deepspeed_plus_gradscaler"), "--format", "sarif")
    assert proc.returncode == 1, proc.stderr
    sarif = json.loads(proc.stdout)
    assert sarif["runs"][0]["results"][0]["ruleId"] == "double-scaling"


def test_cli_scan_does_not_import_torch():
    env = dict(os.environ, NO_COLOR="1")
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ampdoctor", "scan",
         str(RECIPES / "clean_gradscaler_only")],
        capture_output=True, text=True, cwd=REPO, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "torch" not in imported


def test_scanning_all_recipes_at_once_keeps_them_apart():
    """Each recipe is its own project: no import, string or config links across folders."""
    report = scan_paths([RECIPES])
    errors = [f for f in report.findings if f.severity == "error"]
    expected = {case: sorted(owners)
                for case, (sev, owners) in DOUBLE_SCALED.items() if sev == "error"}
    found = {}
    for finding in errors:
        cases = {Path(o["file"]).relative_to(RECIPES).parts[0] for o in finding.evidence["owners"]}
        assert len(cases) == 1, cases
        found[cases.pop()] = _owner_tuples(finding.evidence["owners"])
    assert found == expected


@pytest.mark.parametrize("output", ["record", "scan-json", "sarif"])
def test_ampdoctor_outputs_in_the_tree_do_not_link_scripts(tmp_path, output, capsys):
    """A run record, a scan report or a SARIF log saved inside the project quotes every owner's
    file; read as a config it would join two separate scripts into one training path."""
    for name in ("train_a.py", "train_b.py"):
        (tmp_path / name).write_text(
            "import torch\n"
            "scaler = torch.amp.GradScaler('cuda')\n"
            "def step(model, loss, opt):\n"
            "    scaler.scale(loss).backward()\n"
            "    scaler.step(opt)\n"
            "    scaler.update()\n")
    before = scan_paths([tmp_path])
    assert [f for f in before.findings if f.severity == "error"] == []
    if output == "record":
        saved = {"record_version": 1, "ampdoctor_version": "0.1.0", "verdict": "healthy",
                 "rungs": [{"id": "double-scaling", "details": {"owners": [
                     {"kind": "GradScaler", "file": name, "line": 2, "key_path": None,
                      "detail": "torch.amp.GradScaler('cuda'): on whenever precision == 'fp16'"}
                     for name in ("train_a.py", "train_b.py")]}}]}
        text = json.dumps(saved)
    elif output == "scan-json":
        run_scan([str(tmp_path)], fmt="json")
        text = capsys.readouterr().out
        assert "train_a.py" in text and "train_b.py" in text
    else:  # the shape `--format sarif` writes for a finding with two owners
        text = json.dumps({"$schema": "https://json.schemastore.org/sarif-2.1.0.json",
                           "version": "2.1.0", "runs": [{
                               "tool": {"driver": {"name": "ampdoctor"}},
                               "results": [{"ruleId": "double-scaling", "message": {
                                   "text": "2 loss-scale owners (fp16 GradScaler)"}, "locations": [
                                   {"physicalLocation": {"artifactLocation": {"uri": name}}}
                                   for name in ("train_a.py", "train_b.py")]}]}]})
    (tmp_path / "last_run.json").write_text(text)
    after = scan_paths([tmp_path])
    assert [f for f in after.findings if f.severity == "error"] == []
    assert len(after.owners) == len(before.owners) == 2
