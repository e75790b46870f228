"""Messages for mistakes a newcomer makes: clipping at a max_grad_norm the spec does not set,
and `report` after an interrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import RECIPES, run_cli

CLIPPING_LOOP = '''\
import torch


def train_loop(model, optimizer, micro_batches, run):
    for step, (x, y) in enumerate(micro_batches):
        loss = torch.nn.functional.mse_loss(model(x), y) / run.accumulation_steps
        loss.backward()
        if (step + 1) % run.accumulation_steps == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)  # CLIP
            optimizer.step()
            optimizer.zero_grad()
'''


def test_clipping_at_a_max_grad_norm_the_spec_does_not_set(tmp_path: Path):
    (tmp_path / "clipping.py").write_text(CLIPPING_LOOP)
    shutil.copy(RECIPES / "common.py", tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: common:make_mlp\ndata: common:make_regression_data\n"
                    "loss: common:mse_loss\ntrain_loop: clipping:train_loop\n"
                    "accumulation_steps: 2\nmicro_batch_size: 4\noptimizer_steps: 2\n"
                    "device: cpu\nscan: {paths: [clipping.py]}\n")
    line = CLIPPING_LOOP.splitlines().index(
        next(x for x in CLIPPING_LOOP.splitlines() if x.endswith("# CLIP"))) + 1
    result = run_cli("diagnose", spec, "--out", tmp_path / "runs")
    assert result.returncode == 3, result.stdout + result.stderr
    said = " ".join((result.stdout + result.stderr).replace("│", " ").split())
    assert "run.max_grad_norm is null because the spec has no max_grad_norm" in said
    assert "Set max_grad_norm in the spec" in said
    assert f"clipping.py:{line}" in said


def _write_records(out: Path) -> tuple[Path, Path]:
    """A complete record, then a newer interrupted run's stub, as diagnose writes them."""
    import json
    import os

    from ampdoctor import record as records
    from conftest import CONFIGS

    out.mkdir(exist_ok=True)
    result = run_cli("diagnose", CONFIGS / "broken_missing_average.yaml", "--out", out)
    assert result.returncode == 1, result.stderr
    complete = next(out.glob("*.json"))
    stub = json.loads(complete.read_text())
    stub["verdict"] = "error"
    stub["rungs"] = stub["rungs"][:1]
    stub["error"] = {"type": "UserCodeError",
                     "message": "interrupted by SIGINT after 1 rung(s); the record holds the "
                                "rungs that finished"}
    stub["exit_code"] = 130          # 128 + SIGINT, as diagnose saves it
    newer = out / "29990101-000000-spec.json"
    newer.write_text(records.dumps(stub))
    later = complete.stat().st_mtime + 10
    os.utime(newer, (later, later))
    return complete, newer


def test_report_shows_the_latest_complete_record_not_an_interrupted_stub(tmp_path: Path):
    out = tmp_path / "runs"
    complete, newer = _write_records(out)
    result = run_cli("report", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "missing-accumulation-average" in result.stdout
    assert (f"note: the newest record, {newer.name}, is of an interrupted run; showing "
            f"{complete.name}.") in " ".join(result.stderr.split())
    assert len(result.stderr.strip().splitlines()) == 1
    # only interrupted stubs: the newest is shown, with the note
    complete.unlink()
    result = run_cli("report", "--out", out)
    assert result.returncode == 0, result.stderr
    assert f"{newer.name}, is of an interrupted run; it is shown." \
        in " ".join(result.stderr.split())


def test_an_interrupted_stub_is_known_by_its_exit_code_or_an_old_record_by_its_message():
    from ampdoctor.record import is_interrupted

    message = {"verdict": "error", "error": {"message": "interrupted by SIGTERM after 2 rung(s)"}}
    assert is_interrupted({**message, "exit_code": 143})
    assert is_interrupted(message)                        # written before exit_code existed
    assert not is_interrupted({**message, "exit_code": 3})  # the loop's own words, exit 3
    assert not is_interrupted({"verdict": "error", "exit_code": 1, "error": None})
