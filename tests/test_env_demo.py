"""`ampdoctor env` (versions, device, what each AMP rung runs as here) and `ampdoctor demo` (a
shipped example, diagnosed without the repository)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import torch

from conftest import ROOT, run_cli, run_cli_process


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
