"""CLI conventions: `schema`, `init` then `diagnose` on what it wrote, the overrides on
`diagnose`, progress on stderr, a loop error's user frames and `--debug` traceback."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, RECIPES, marked_line, run_cli, run_cli_process

TRAIN_PY = textwrap.dedent('''\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    GRADIENT_ACCUMULATION_STEPS = 2
    MAX_GRAD_NORM = 1.0


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x):
            return self.body(x)


    def get_batches():
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g))
                for _ in range(6)]


    def train(model, optimizer, micro_batches, run):
        scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
        for i, (x, y) in enumerate(micro_batches):
            with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                                enabled=run.autocast_dtype is not None):
                loss = F.mse_loss(model(x).float(), y) / run.accumulation_steps
            scaler.scale(loss).backward()
            if (i + 1) % run.accumulation_steps == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
    ''')


def test_schema_is_the_spec_model_and_validates_the_samples(tmp_path: Path) -> None:
    result = run_cli("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    # model and train_loop are required unless lightning / hf_trainer replace them (a rule
    # of the spec model, not of one key)
    assert set(schema["required"]) == {"data", "accumulation_steps"}
    assert {"train_loop", "hf_trainer", "lightning", "model"} <= set(schema["properties"])
    assert "spec_path" not in schema["properties"]
    for key in ("tolerances", "ddp", "seed", "scan", "precisions", "rungs", "timeout_s"):
        assert key in schema["properties"], key
    assert schema["additionalProperties"] is False
    # every sample config uses only keys the schema knows
    for config in CONFIGS.glob("*.yaml"):
        data = yaml.safe_load(config.read_text())
        assert set(data) <= set(schema["properties"]), config.name


def test_init_fills_the_spec_from_the_file_and_diagnose_runs_it(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(TRAIN_PY)
    result = run_cli("init", "src/train.py", "-o", "triage.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "next: ampdoctor diagnose triage.yaml" in result.stderr
    spec = yaml.safe_load((tmp_path / "triage.yaml").read_text())
    assert spec["project_root"] == "src"
    assert (spec["model"], spec["data"], spec["train_loop"]) == (
        "train:Net", "train:get_batches", "train:train")
    assert spec["accumulation_steps"] == 2 and spec["max_grad_norm"] == 1.0
    text = (tmp_path / "triage.yaml").read_text()
    assert "# yaml-language-server: $schema=ampdoctor.schema.json\n" in text
    # a second init never overwrites
    again = run_cli("init", "src/train.py", "-o", "triage.yaml", cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr
    assert (tmp_path / "triage.yaml").read_text() == text
    run = run_cli("diagnose", "triage.yaml", "--device", "cpu", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.record["verdict"] == "healthy"


def test_init_without_a_file_writes_todos_that_diagnose_names(tmp_path: Path) -> None:
    assert run_cli("init", cwd=tmp_path).returncode == 0
    text = (tmp_path / "triage.yaml").read_text()
    assert "# TODO" in text and "accumulation_steps: 4" in text
    run = run_cli("diagnose", "triage.yaml", cwd=tmp_path)
    assert run.returncode == 2
    assert "spec key 'model': module 'models' was not found" in run.stderr


def test_overrides_change_the_run_and_bad_ones_are_usage_errors(tmp_path: Path) -> None:
    result = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--json", "--out", tmp_path,
                     "--steps", "2", "--precisions", "fp32,bf16", "--rungs",
                     "fp32-accum,bf16-no-scaler,fp16-scaler", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["optimizer_steps"] == 2 and record["device"] == "cpu"
    status = {r["id"]: r for r in record["rungs"]}
    assert status["fp32-accum"]["status"] == "pass"
    assert status["fp32-accum"]["summary"].startswith("2 optimizer steps")
    assert status["bf16-no-scaler"]["status"] == "pass"
    assert status["fp16-scaler"]["status"] == "skip"       # fp16 not among the precisions
    assert status["skips"]["status"] == "skip"
    assert "not among the rungs asked for" in status["skips"]["summary"]
    bad = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--rungs", "fp16", "--out", tmp_path)
    assert bad.returncode == 2 and "'fp16' is not a rung" in bad.stderr
    bad = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--precisions", "fp8",
                  "--out", tmp_path)
    assert bad.returncode == 2 and "precisions" in bad.stderr
    bad = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--steps", "5", "--out", tmp_path)
    assert bad.returncode == 2 and "5 x 4 x 8 = 160 are needed" in bad.stderr


def test_progress_in_a_log_is_one_line_per_rung_with_its_place_and_time_left(tmp_path: Path):
    # stderr is not a terminal here: one line per rung that runs, none per optimizer step
    result = run_cli_process("diagnose", CONFIGS / "healthy_sgd.yaml", "--out", tmp_path,
                             "--rungs", "reproducibility,fp32-accum,fp16-scaler")
    assert result.returncode == 0
    progress = [line.strip() for line in result.stderr.splitlines()
                if line.strip().startswith("rung ")]
    assert [line.split(" · ")[0] for line in progress] == [
        "rung 1/3 reproducibility", "rung 2/3 fp32-accum", "rung 3/3 fp16-scaler"]
    assert progress[0].endswith("s so far")            # nothing finished to go by yet
    assert all(re.search(r" · ~\d+ (s|min) left$", line) for line in progress[1:]), progress
    assert not any("step" in line for line in progress)


def test_the_live_line_names_the_step_and_the_time_left():
    from ampdoctor.cli.progress_line import describe
    from ampdoctor.core.progress import eta_s
    event = {"rung": "bf16-no-scaler", "precision": "bf16", "step": 2, "steps": 3,
             "rung_index": 3, "rungs": 7, "eta_s": 40.2, "elapsed_s": 12.0}
    assert describe(event) == "rung 3/7 bf16-no-scaler · bf16 step 2/3 · ~40 s left"
    # two rungs took 4 s and 6 s: five rungs left (the current one 1 s in) take ~24 s
    assert eta_s([4.0, 6.0], 5, 1.0) == 24.0
    assert eta_s([], 5, 1.0) is None
    # weighed by cost: 8 s for a rung of weight 8 is 1 s a unit; 3.5 units left, 0.5 s run
    assert eta_s([8.0], 3.5, 0.5, finished_weight=8.0) == 3.0


def test_the_estimate_weighs_the_rungs_still_to_run_by_their_cost():
    from ampdoctor.core import progress
    seen = []
    with progress.listening(seen.append):
        progress.plan(["reproducibility", "fp32-accum", "skips"],
                      {"reproducibility": 8.0, "fp32-accum": 1.0, "skips": 1.0})
        progress.rung("reproducibility")
        progress._state["rung_started"] -= 8.0       # it took 8 s
        progress.rung("fp32-accum")
    last = seen[-1]
    assert last["rung"] == "fp32-accum" and last["rung_index"] == 2 and last["rungs"] == 3
    # 1 s per unit of cost, 2 units left (this rung and the next): about 2 s, not 16 s
    assert 1.9 <= last["eta_s"] <= 2.0


def test_loop_error_names_the_innermost_frame_and_the_loops_line(tmp_path: Path) -> None:
    recipe = RECIPES / "broken_loop_error.py"
    result = run_cli("diagnose", CONFIGS / "broken_loop_error.yaml", "--json", "--out",
                     tmp_path, "--rungs", "fp32-accum")
    assert result.returncode == 3
    finding = result.record["findings"][0]
    assert finding["kind"] == "loop-error"
    assert finding["location"]["line"] == marked_line(recipe, "loop-error")
    loop_line = next(n for n, line in enumerate(recipe.read_text().splitlines(), 1)
                     if "x = add_bias_column(x)" in line)
    assert finding["evidence"]["loop_line"] == f"{recipe}:{loop_line}"
    assert f"called from the loop at broken_loop_error.py:{loop_line}" in finding["message"]
    assert "Traceback (most recent call last)" in finding["traceback"]
    # --debug prints it; without --debug it stays in the record only
    debug = run_cli("diagnose", CONFIGS / "broken_loop_error.yaml", "--debug", "--out",
                    tmp_path, "--rungs", "fp32-accum")
    assert debug.returncode == 3
    assert "Traceback (most recent call last)" in debug.stderr
    assert "in add_bias_column" in debug.stderr
    plain = run_cli("diagnose", CONFIGS / "broken_loop_error.yaml", "--out", tmp_path,
                    "--rungs", "fp32-accum")
    assert "Traceback" not in plain.stderr


def test_shell_completion_is_offered() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout


@pytest.mark.slow
def test_overrides_reach_the_ddp_ranks(tmp_path: Path) -> None:
    # the ranks rebuild the spec in their own processes: with the override, not the file's 3
    result = run_cli("diagnose", CONFIGS / "healthy_sgd_ddp.yaml", "--steps", "2", "--rungs",
                     "ddp-sync", "--json", "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    ddp = next(r for r in result.record["rungs"] if r["id"] == "ddp-sync")
    assert ddp["status"] == "pass"
    assert "(2 steps," in ddp["summary"]


def test_init_reads_the_clip_threshold_of_the_two_step_clip(tmp_path: Path) -> None:
    """accelerate's path: get_total_norm, then clip_grads_with_norm_(params, max_norm, total)."""
    source = (TRAIN_PY.replace("MAX_GRAD_NORM = 1.0\n", "")
              .replace("torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)",
                       "params = list(model.parameters())\n"
                       "            total = torch.nn.utils.get_total_norm(\n"
                       "                [p.grad for p in params if p.grad is not None])\n"
                       "            torch.nn.utils.clip_grads_with_norm_(params, 0.5, total)"))
    assert "clip_grads_with_norm_(params, 0.5" in source and "MAX_GRAD_NORM" not in source
    (tmp_path / "train.py").write_text(source)
    result = run_cli("init", "train.py", "-o", "triage.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load((tmp_path / "triage.yaml").read_text())["max_grad_norm"] == 0.5


@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (2, 2), (3, 3), (256, 0), (-1, 255),
                                          ("stopped", 1), (["stopped"], 1)])
def test_the_console_script_leaves_with_its_exit_code_its_output_and_its_exit_handlers(
        code, status):
    """`cli.leave` (the console script's exit without the interpreter's teardown): the
    status SystemExit would give, what was written to stdout (buffered, a pipe) whole, the
    exit handlers run (an unused early worker is ended there), a string said on stderr."""
    import sys
    program = ("import atexit, sys\n"
               "from ampdoctor.cli import leave\n"
               "atexit.register(lambda: print('handler ran', file=sys.stderr))\n"
               "sys.stdout.write('x' * 100000)\n"
               f"leave({code!r})\n"
               "print('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == status
    assert proc.stdout == "x" * 100000
    assert "handler ran" in proc.stderr
    assert ("stopped" in proc.stderr) == (code in ("stopped", ["stopped"]))


def _leave_in_a_process(lines: str) -> subprocess.CompletedProcess:
    import sys
    return subprocess.run([sys.executable, "-c", "import sys\n" + lines], capture_output=True,
                          text=True, timeout=60)


def test_a_process_that_ran_training_code_leaves_the_interpreter_s_way(tmp_path):
    """Where torch is imported (an in-process diagnose, rank 0 under torchrun: the training
    code ran in this process) the interpreter's own exit is taken: a file the code left open,
    its writes still buffered, is whole afterwards (os._exit would lose them)."""
    log = tmp_path / "log.txt"
    lines = (f"LOG = open({str(log)!r}, 'w')\n"
             "LOG.write('written by the loop')\n"
             "import types; sys.modules.setdefault('torch', types.ModuleType('torch'))\n"
             "from ampdoctor.cli import leave\n"
             "leave(3)\n")
    proc = _leave_in_a_process(lines)
    assert proc.returncode == 3, proc.stderr
    assert log.read_text() == "written by the loop"


def test_a_closed_stdout_does_not_change_the_exit_status():
    proc = _leave_in_a_process("sys.stdout.close()\nfrom ampdoctor.cli import leave\nleave(2)\n")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
