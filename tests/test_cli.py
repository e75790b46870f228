"""The CLI outside diagnose: version, help without torch, report, explain, exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from ampdoctor import __version__
from ampdoctor.core.findings import RUNG_IDS
from ampdoctor.kinds import CATALOGUE
from conftest import CONFIGS, RECIPES, marked_line, run_cli, run_cli_process


def _modules_after(*args: str) -> set[str]:
    code = ("import sys\nfrom ampdoctor.cli import app\n"
            f"try:\n    app({list(args)!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout


def test_version():
    result = run_cli_process("--version")       # the installed console script runs
    assert result.returncode == 0
    assert __version__ in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["explain"], ["explain", "missing-no-sync"],
                                  ["scan", str(RECIPES / "healthy_sgd.py")]])
def test_commands_that_run_no_model_do_not_import_torch(args):
    assert _modules_after(*args).strip().endswith("NO-TORCH")


@pytest.fixture(scope="module")
def saved_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    result = run_cli("diagnose", CONFIGS / "broken_missing_average.yaml", "--out", out)
    assert result.returncode == 1
    return out


@pytest.mark.xdist_group("saved_record")   # one module fixture, one worker
def test_report_rerenders_latest_without_torch(saved_record):
    result = run_cli("report", "--out", saved_record)
    assert result.returncode == 0      # rendered: a postmortem step does not fail
    assert "missing-accumulation-average" in result.stdout
    assert run_cli("report", "--out", saved_record, "--record-exit-code").returncode == 1
    assert _modules_after("report", "--out", str(saved_record)).strip().endswith("NO-TORCH")


@pytest.mark.xdist_group("saved_record")   # one module fixture, one worker
def test_report_json_and_html(saved_record, tmp_path):
    result = run_cli("report", "--out", saved_record, "--json")
    record = json.loads(result.stdout)
    assert record["failed_rung"] == "fp32-accum"
    assert [r["id"] for r in record["rungs"]] == list(RUNG_IDS)
    target = tmp_path / "postmortem.html"
    result = run_cli("report", "--out", saved_record, "--html", "-o", target)
    html = target.read_text()
    assert "missing-accumulation-average" in html
    assert "<svg" not in html or "optimizer step" in html
    assert "broken_missing_average.py" in html


def test_report_of_an_old_record(tmp_path):
    old = {"ampdoctor_version": "0.0.1", "verdict": "failed", "failed_rung": "fp32-accum",
           "rungs": [{"id": "fp32-accum", "status": "fail"}],
           "findings": [{"rung": "fp32-accum", "kind": "double-average", "severity": "error"}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    result = run_cli("report", path)
    assert result.returncode == 0
    assert "double-average" in result.stdout
    html = tmp_path / "old.html"
    assert run_cli("report", path, "--html", "-o", html).returncode == 0
    assert "double-average" in html.read_text()


def test_report_without_records_is_a_usage_error(tmp_path):
    result = run_cli("report", "--out", tmp_path / "none")
    assert result.returncode == 2
    assert "no saved run record" in result.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_cli("report", bad).returncode == 2


def test_json_output_is_only_json(tmp_path):
    result = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--json", "--out", tmp_path)
    assert result.returncode == 0
    record = json.loads(result.stdout)          # nothing else on stdout
    for key in ("ampdoctor_version", "spec", "name", "device", "verdict", "failed_rung", "rungs",
                "findings", "series"):
        assert key in record
    assert record["name"] == "healthy_sgd"


def test_explain_every_kind():
    for kind in CATALOGUE:
        result = run_cli("explain", kind)
        assert result.returncode == 0
        assert CATALOGUE[kind].title in result.stdout
    result = run_cli("explain", "clip-befor-unscale")
    assert result.returncode == 2
    assert "clip-before-unscale" in result.stderr


def test_explain_list_json_gives_every_kind_and_its_decider():
    import importlib
    result = run_cli("explain", "--list", "--json")
    assert result.returncode == 0
    entries = json.loads(result.stdout)
    assert [e["kind"] for e in entries] == list(CATALOGUE)
    for entry in entries:
        assert set(entry) == {"kind", "title", "why", "example", "fix", "measured", "decided_in"}
        module, _, function = entry["decided_in"].partition(":")
        assert callable(getattr(importlib.import_module(module), function))
    shown = run_cli("explain", "double-average")
    assert "ampdoctor.kinds.accumulation:double_average" in shown.stdout
    assert run_cli("explain", "double-average", "--list").returncode == 2


def test_missing_spec_file_is_exit_2(tmp_path):
    result = run_cli("diagnose", tmp_path / "nope.yaml")
    assert result.returncode == 2
    assert "does not exist" in result.stderr


def test_torch_warnings_from_a_wrapped_call_name_the_users_line(tmp_path):
    """torch warns about scheduler.step() before optimizer.step() at its caller's line; with
    the probe in between that caller is ampdoctor, so the warning is said again at the user's
    scheduler call, once. (In a process of its own: pytest records warnings in this one.)
    --verbose shows the loop's output (warnings included) as it comes."""
    result = run_cli_process("diagnose", CONFIGS / "broken_scheduler_per_microbatch.yaml",
                             "--verbose", "--out", tmp_path)
    recipe = RECIPES / "broken_scheduler_per_microbatch.py"
    line = marked_line(recipe, "scheduler-per-microbatch")
    warned = [ln for ln in result.stderr.splitlines() if "UserWarning" in ln]
    assert len(warned) == 1, result.stderr
    assert warned[0].startswith(f"{recipe}:{line}: UserWarning: Detected call of `lr_scheduler")
    assert "recorder.py" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["report", "-o", "x.html"], "-o/--output writes the HTML page: add --html"),
    (["report", "--html", "--json"], "--html and --json: choose one"),
    (["scan", ".", "--json", "--format", "sarif"], "--json and --format sarif: choose one"),
])
def test_options_that_clash_are_a_usage_error(tmp_path, args, message):
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "x.html").exists()


def test_help_lists_the_exit_codes():
    result = run_cli("--help")
    assert result.returncode == 0
    shown = " ".join(result.stdout.split())
    for text in ("0 healthy", "1 a rung failed", "2 bad spec or usage", "3 your model",
                 "4 an internal ampdoctor error", "report, export-test: 0 rendered or written"):
        assert text in shown, text


@pytest.mark.xdist_group("saved_record")   # one module fixture, one worker
def test_piped_output_fits_columns_and_keeps_file_line_whole(saved_record):
    """Not a terminal: laid out at COLUMNS (80 here), and the finding's file:line stays on
    one line (grep finds it). More in test_piped_output.py."""
    result = run_cli("report", "--out", saved_record, env={"COLUMNS": "80"})
    assert result.returncode == 0
    assert max(len(line) for line in result.stdout.splitlines()) == 80
    assert any("missing-accumulation-average" in line and "[fp32-accum]" in line
               for line in result.stdout.splitlines())
    assert any(re.search(r"broken_missing_average\.py:\d+", line)
               for line in result.stdout.splitlines())


def test_a_record_carries_its_environment(tmp_path):
    import platform
    import shutil

    project = tmp_path / "project"
    project.mkdir()
    for name in ("common.py", "healthy_sgd.py"):
        shutil.copy(RECIPES / name, project / name)
    spec_text = (CONFIGS / "healthy_sgd.yaml").read_text().replace("../recipes", str(project))
    (project / "spec.yaml").write_text(spec_text)
    git = ["git", "-C", str(project), "-c", "user.email=t@t", "-c", "user.name=t"]
    if shutil.which("git"):
        subprocess.run(git + ["init", "-q"], check=True)
        subprocess.run(git + ["add", "."], check=True)
        subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
    result = run_cli("diagnose", project / "spec.yaml", "--json", "--out", tmp_path / "runs")
    assert result.returncode == 0, result.stderr
    env = result.record["environment"]
    assert env["python"] == platform.python_version()
    assert env["torch"] and env["date"].endswith("+00:00") and env["host"]
    assert env["spec_text"] == spec_text
    if shutil.which("git"):
        head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True)
        assert env["git_commit"] == head.stdout.strip()      # clean tree: no +dirty
    page = tmp_path / "p.html"
    assert run_cli("report", "--out", tmp_path / "runs", "--html", "-o", page).returncode == 0
    assert env["git_commit"][:12] in page.read_text() if env["git_commit"] else True
