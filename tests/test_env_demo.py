"""`ampdoctor env` (versions, device, what each AMP rung runs as here) and `ampdoctor demo` (a
shipped example, diagnosed without the repository)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from ampdoctor.cli.demo import DEFAULT, EXAMPLES, EXAMPLES_DIR
from conftest import RECIPES, ROOT, marked_line, run_cli, run_cli_process


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# -- env ------------------------------------------------------------------------------------------

def test_env_json_states_the_versions_and_what_each_rung_runs_as():
    run = run_cli_process("env", "--json", cwd=ROOT)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    import ampdoctor
    assert data["ampdoctor"] == ampdoctor.__version__
    assert data["torch"] == torch.__version__
    assert data["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert data["cuda"]["available"] is torch.cuda.is_available()
    assert data["cuda"]["version"] == torch.version.cuda
    for name in ("accelerate", "transformers", "lightning", "deepspeed"):
        assert data["frameworks"][name] == _version(name), name
    rungs = {r["id"]: r for r in data["rungs"]}
    assert list(rungs) == ["reproducibility", "fp32-accum", "bf16-no-scaler", "fp16-scaler",
                           "double-scaling", "clip-space", "skips", "ddp-sync"]
    if not torch.cuda.is_available():
        assert data["device"] == "cpu"
        assert rungs["bf16-no-scaler"]["as"] == "bf16 autocast on the CPU, no GradScaler"
        assert rungs["bf16-no-scaler"]["runs"] is True
        assert rungs["fp16-scaler"]["as"] == ('fp16 autocast on the CPU with '
                                              'torch.amp.GradScaler("cpu")')
        assert "gives float16" in rungs["fp16-scaler"]["check"]
        assert "gloo" in rungs["ddp-sync"]["as"]
    else:
        assert data["device"] == "cuda"
        assert 'torch.amp.GradScaler("cuda")' in rungs["fp16-scaler"]["as"]
        assert data["cuda"]["devices"][0]["name"] == torch.cuda.get_device_name(0)


def test_env_text_matches_the_json():
    data = json.loads(run_cli("env", "--json").stdout)
    text = run_cli("env").stdout
    assert f"torch              {data['torch']}" in text
    for rung in data["rungs"]:
        assert rung["as"] in text
    for name, version in data["frameworks"].items():
        assert f"{name:<19}{version or 'not installed'}" in text


def test_env_reads_framework_versions_without_importing_them():
    code = ("import sys\n"
            "from ampdoctor.cli.env import collect\n"
            "data = collect('cpu')\n"
            "assert data['frameworks']['transformers'], data['frameworks']\n"
            "bad = [m for m in ('accelerate', 'transformers', 'lightning', 'deepspeed') "
            "if m in sys.modules]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_env_without_torch_still_answers():
    code = ("import sys, json\n"
            "sys.modules['torch'] = None   # `import torch` raises ImportError\n"
            "from ampdoctor.cli.env import collect, _text\n"
            "data = collect()\n"
            "assert data['torch'] is None and data['rungs'] == [], data\n"
            "assert 'torch' in data['torch_error']\n"
            "print(_text(data))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cannot be imported" in proc.stdout
    assert "torch cannot be imported: no rung can run" in proc.stdout


def test_env_bad_device_is_a_usage_error():
    run = run_cli("env", "--device", "tpu")
    assert run.returncode == 2 and "not a device" in run.stderr
    if not torch.cuda.is_available():
        run = run_cli("env", "--device", "cuda:0")
        assert run.returncode == 2 and "no CUDA device" in run.stderr


# -- demo -----------------------------------------------------------------------------------------

def test_every_example_ships_its_loop_and_spec_and_matches_its_recipe():
    assert {e.expected for e in EXAMPLES} >= {"healthy", "clip-before-unscale"}
    for item in EXAMPLES:
        loop = EXAMPLES_DIR / f"{item.name}.py"
        assert loop.read_bytes() == (RECIPES / f"{item.name}.py").read_bytes(), item.name
        spec = (EXAMPLES_DIR / f"{item.name}.yaml").read_text()
        assert f"train_loop: {item.name}:train_loop" in spec
        if item.expected != "healthy":
            line = marked_line(loop, item.expected)
            assert f"Expected: {item.expected} at {item.name}.py:{line}" in spec


def test_the_examples_common_builds_what_the_recipes_common_builds():
    import importlib.util

    def load(path, name):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    shipped = load(EXAMPLES_DIR / "common.py", "_shipped_common")
    recipes = load(RECIPES / "common.py", "_recipes_common")
    for a, b in zip(shipped.make_regression_data(), recipes.make_regression_data(), strict=True):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    one = shipped.make_mlp()
    torch.manual_seed(0)
    two = recipes.make_mlp()
    assert all(torch.equal(p, q) for p, q in zip(one.parameters(), two.parameters(),
                                                 strict=True))
    batch = shipped.make_regression_data()
    assert torch.equal(shipped.mse_loss(one, batch), recipes.mse_loss(two, batch))


def test_demo_list_names_every_example():
    run = run_cli("demo", "--list")
    assert run.returncode == 0
    for item in EXAMPLES:
        assert item.name in run.stdout and f"expect {item.expected}" in run.stdout
    assert f"{DEFAULT}" in run.stdout and "(the default)" in run.stdout


def test_demo_unknown_name_is_a_usage_error(tmp_path):
    run = run_cli("demo", "broken_missing_averge", cwd=tmp_path)
    assert run.returncode == 2
    assert "Did you mean 'broken_missing_average'?" in run.stderr
    assert not (tmp_path / ".ampdoctor").exists()


@pytest.mark.parametrize("item", EXAMPLES, ids=lambda e: e.name)
def test_demo_diagnoses_each_example_from_a_temp_cwd(tmp_path, item):
    run = run_cli("demo", item.name, "--json", cwd=tmp_path)
    record = run.record
    copy = tmp_path / ".ampdoctor" / "demo" / item.name / f"{item.name}.py"
    assert copy.is_file() and (copy.parent / "common.py").is_file()
    assert record["spec"] == str((copy.parent / f"{item.name}.yaml").resolve())
    assert list((tmp_path / ".ampdoctor" / "runs").glob("*.json"))
    if item.expected == "healthy":
        assert run.returncode == 0, run.stderr
        assert record["verdict"] == "healthy" and record["findings"] == []
        return
    assert run.returncode == 1, run.stderr
    errors = [f for f in record["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == [item.expected]
    assert errors[0]["location"]["file"] == str(copy.resolve())
    assert errors[0]["location"]["line"] == marked_line(copy, item.expected)
    assert "exit 1 is this example's expected result" in run.stderr


def test_demo_runs_from_a_plain_wheel_install(tmp_path):
    """Build the wheel (what `pip install ampdoctor` installs), install it into a folder of its
    own, and run `ampdoctor demo` from an empty working directory with that install first on
    the path: the examples are package data, not files of the repository."""
    import shutil
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "ampdoctor", source / "ampdoctor",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist",
                          str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("ampdoctor-*.whl")
    target = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", target, wheel], check=True,
                   capture_output=True, timeout=300)
    assert (target / "ampdoctor" / "examples" / "broken_missing_average.yaml").is_file()
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(target), NO_COLOR="1")
    where = subprocess.run([sys.executable, "-c", "import ampdoctor; print(ampdoctor.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert where.stdout.strip() == str(target / "ampdoctor" / "__init__.py"), where
    proc = subprocess.run([sys.executable, "-m", "ampdoctor", "demo", "broken_missing_average",
                           "--json"], capture_output=True, text=True, cwd=work, env=env,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr
    record = json.loads(proc.stdout)
    assert record["ampdoctor_version"]
    [finding] = [f for f in record["findings"] if f["severity"] == "error"]
    assert finding["kind"] == "missing-accumulation-average"
    copy = work / ".ampdoctor" / "demo" / "broken_missing_average" / "broken_missing_average.py"
    assert finding["location"]["file"] == str(copy.resolve())
    assert finding["location"]["line"] == marked_line(copy, "missing-accumulation-average")
