"""Script mode end to end (CONTRACT §8): the real CLI on unmodified training scripts written as
real ones are (recipes/scripts/), healthy and broken, with and without --reference-args.

Each case runs `ampdoctor diagnose SCRIPT.py --json ... -- ARGS` in this process (the script
itself in child processes) and checks the verdict, the rung, the kind and the script's line.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from conftest import RECIPES, marked_line, run_cli

SCRIPTS = RECIPES / "scripts"
AMP = SCRIPTS / "amp_recipe.py"
LOADER = SCRIPTS / "main_dataloader.py"
NANOGPT = SCRIPTS / "nanogpt_style.py"
MODULE = SCRIPTS / "module_loop.py"
BF16 = SCRIPTS / "bf16_scheduler.py"
FINETUNE = SCRIPTS / "bf16_finetune.py"

AMP_REF = "--accum-steps 1 --batch-size 32 --amp"
LOADER_REF = "--grad-accum 1 --batch-size 32 --amp"
MODULE_REF = "--accum 1 --bs 24"
NANOGPT_REF = "--gradient_accumulation_steps=1 --batch_size=16"
FINETUNE_REF = "--grad-accum-steps 1 --batch-size 32"


def diagnose(tmp_path: Path, script: Path, args: list[str], reference: str | None = None,
             *options: str):
    ref = ["--reference-args", reference] if reference is not None else []
    return run_cli("diagnose", script, "--json", "--out", tmp_path / "runs", *ref, *options,
                   "--", *args)


def statuses(record: dict) -> dict[str, str]:
    return {r["id"]: r["status"] for r in record["rungs"]}


pytestmark = pytest.mark.xdist_group("script_mode")


@pytest.mark.parametrize("script, args, reference, skipped", [
    (AMP, ["--amp"], AMP_REF, {"ddp-sync"}),
    (LOADER, ["--amp"], LOADER_REF, {"clip-space", "ddp-sync"}),
    (NANOGPT, [], NANOGPT_REF, {"bf16-no-scaler", "fp16-scaler", "clip-space", "skips",
                                "ddp-sync"}),
    (MODULE, [], MODULE_REF, {"fp16-scaler", "clip-space", "skips", "ddp-sync"}),
], ids=["amp-recipe", "main-dataloader", "nanogpt-style", "module-level-loop"])
def test_healthy_scripts_pass_clean(tmp_path, script, args, reference, skipped):
    result = diagnose(tmp_path, script, args, reference)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy"
    assert record["findings"] == []   # no error, no warning
    assert record["script"] == str(script) and record["args"] == args
    assert record["reference_args"] == reference.split()
    got = statuses(record)
    assert {r for r, s in got.items() if s == "skip"} == skipped
    assert all(s == "pass" for r, s in got.items() if r not in skipped)
    assert record["notes"] == []
    assert record["accumulation_steps"] == record["found"]["accumulation_steps"]


def test_found_says_what_the_script_is(tmp_path):
    record = diagnose(tmp_path, AMP, ["--amp"], AMP_REF, "--steps", "2").record
    assert record["found"]["text"] == ("found: 1 model (Sequential, 2,177 params), SGD, "
                                       "GradScaler, autocast fp16, K = 4, micro-batch 8, "
                                       "reference batch 32")
    assert record["optimizer_steps"] == 2
    model = record["found"]["models"][0]
    assert (model["type"], model["parameters"], model["line"]) == (
        "Sequential", 2177, next(n for n, text in enumerate(AMP.read_text().splitlines(), 1)
                                 if text.startswith("net = nn.Sequential(")))
    fp32 = next(r for r in record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["summary"].startswith("2 optimizer steps match the fp32 reference")


@pytest.mark.parametrize("script, args, reference, rung, kind", [
    (AMP, ["--amp", "--bug", "no-average"], AMP_REF, "fp32-accum",
     "missing-accumulation-average"),
    (AMP, ["--amp", "--bug", "zero-grad-inside"], AMP_REF, "fp32-accum",
     "zero-grad-inside-accumulation"),
    # (a clip that bites in the reference but not on a quarter of the gradient would change the
    # factor from step to step: the threshold is set out of reach)
    (AMP, ["--amp", "--bug", "double-average", "--max-grad-norm", "100"],
     AMP_REF + " --max-grad-norm 100", "fp32-accum", "double-average"),
    (AMP, ["--amp", "--bug", "no-update"], AMP_REF, "fp16-scaler", "loop-error"),
    (AMP, ["--amp", "--bug", "clip-before-unscale"], AMP_REF, "fp16-scaler",
     "clip-before-unscale"),
    (LOADER, ["--amp", "--bug", "scheduler-per-microbatch"], LOADER_REF, "fp32-accum",
     "scheduler-per-microbatch"),
    (LOADER, ["--amp", "--bug", "step-per-microbatch"], LOADER_REF, "fp32-accum",
     "step-per-microbatch"),
    (MODULE, ["--no-average"], MODULE_REF, "fp32-accum", "missing-accumulation-average"),
], ids=["no-average", "zero-grad-inside", "double-average", "step-without-update",
        "clip-before-unscale", "scheduler-per-microbatch",
        "step-per-microbatch", "module-level-no-average"])
def test_broken_scripts_name_kind_rung_and_line(tmp_path, script, args, reference, rung, kind):
    result = diagnose(tmp_path, script, args, reference)
    assert result.returncode == (3 if kind == "loop-error" else 1), result.stderr
    record = result.record
    assert record["verdict"] == ("error" if kind == "loop-error" else "failed")
    assert record["failed_rung"] == rung
    first = record["findings"][0]
    assert (first["rung"], first["kind"], first["severity"]) == (rung, kind, "error")
    assert Path(first["location"]["file"]).resolve() == script.resolve()
    assert first["location"]["line"] == marked_line(script, kind)


def test_without_reference_the_trace_rungs_still_run(tmp_path):
    record = diagnose(tmp_path, AMP, ["--amp", "--bug", "clip-before-unscale"], None,
                      "--no-reference").record
    got = statuses(record)
    assert got["fp32-accum"] == "skip" and got["bf16-no-scaler"] == "skip"
    assert "--reference-args" in next(r["summary"] for r in record["rungs"]
                                      if r["id"] == "fp32-accum")
    # the clip's norm over the unscaled norm is the loss scale: measured from the trace alone
    assert record["failed_rung"] == "clip-space"
    errors = [f for f in record["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["location"]["line"]) for f in errors] == [
        ("clip-before-unscale", marked_line(AMP, "clip-before-unscale"))]
    assert errors[0]["evidence"]["measured"] == pytest.approx(errors[0]["evidence"]["scale"])
    assert any("no reference" in n and "--reference-args" in n and "K = 4, micro-batch 8" in n
               for n in record["notes"])


def test_without_reference_nothing_compared_is_inconclusive_not_healthy(tmp_path):
    result = diagnose(tmp_path, LOADER, ["--amp"], None, "--no-reference")
    assert result.returncode == 2, result.stderr
    record = result.record
    assert record["verdict"] == "inconclusive" and record["exit_code"] == 2
    assert record["findings"] == []
    assert statuses(record)["skips"] == "pass"
    assert "no rung compared an update" in record["inconclusive"]
    assert "--reference-args" in record["inconclusive"]


def test_dataloader_worker_processes_run_as_usual(tmp_path):
    """The script's DataLoader workers are children of the process that runs it."""
    # (no reference: each run of this script starts two worker processes, about a second)
    result = diagnose(tmp_path, LOADER, ["--workers", "2"], None, "--steps", "2")
    assert result.returncode == 0, result.stderr     # the reference inferred: compared
    assert result.record["reference_args"] == ["--workers", "2", "--grad-accum", "1",
                                               "--batch-size", "32"]
    assert result.record["findings"] == []
    got = statuses(result.record)
    assert got["reproducibility"] == "pass" and got["skips"] == "pass"
    assert result.record["found"]["micro_batch_size"] == 8


def test_data_the_reference_cannot_reproduce_is_said_not_judged(tmp_path):
    result = diagnose(tmp_path, MODULE, ["--fresh-data"], MODULE_REF + " --fresh-data")
    record = result.record
    assert result.returncode == 2 and record["findings"] == []
    assert record["verdict"] == "inconclusive" and "contents differ" in record["inconclusive"]
    fp32 = next(r for r in record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["status"] == "skip"
    assert "contents differ" in fp32["summary"] and "seed" in fp32["summary"]
    assert any("does not read the run's micro-batches" in n for n in record["notes"])


def test_script_usage_errors(tmp_path):
    missing = run_cli("diagnose", tmp_path / "nope.py", "--out", tmp_path / "runs")
    assert missing.returncode == 2 and "no such script" in missing.stderr
    quoting = diagnose(tmp_path, AMP, [], '--batch-size "32')
    assert quoting.returncode == 2 and "--reference-args" in quoting.stderr
    spec_args = run_cli("diagnose", RECIPES.parent / "sample_configs" / "healthy_sgd.yaml",
                        "--out", tmp_path / "runs", "--", "--lr", "1")
    assert spec_args.returncode == 2 and "script mode" in spec_args.stderr


def test_a_script_that_fails_before_stepping_is_exit_3_at_its_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\n"
                      "model = torch.nn.Linear(2, 1)\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "raise RuntimeError('no data found')\n")
    result = diagnose(tmp_path, script, [], None, "--no-reference")
    assert result.returncode == 3
    assert result.record["error"]["location"]["line"] == 4
    assert "no data found" in result.record["error"]["message"]
    # an option the script's parser refuses is the user's usage (exit 2, argparse's words)
    bad_arg = diagnose(tmp_path, AMP, ["--no-such-flag"])
    assert bad_arg.returncode == 2, bad_arg.stderr
    assert "unrecognized arguments: --no-such-flag" in bad_arg.stderr
    assert "the script's arguments (--no-such-flag)" in bad_arg.stderr


def test_a_first_run_that_fails_says_whether_the_script_or_the_reference_is_at_fault(tmp_path):
    """The reference's first run stopped: the script run with the user's own arguments says
    whose fault it is (a script that does not compile, or a batch the data cannot hold)."""
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\ndef step(:\n    pass\n")
    result = diagnose(tmp_path, broken, ["--lr", "1"], "--lr 1")
    assert result.returncode == 3
    error = result.record["error"]
    assert error["message"].startswith("the script run with your arguments (--lr 1) raised")
    assert "SyntaxError" in error["message"] and "reference" not in error["message"]
    assert (Path(error["location"]["file"]).name, error["location"]["line"]) == ("broken.py", 3)
    small = tmp_path / "small.py"
    small.write_text("import argparse\nimport torch\n"
                     "p = argparse.ArgumentParser()\n"
                     "p.add_argument('--accum-steps', type=int, default=4)\n"
                     "p.add_argument('--batch-size', type=int, default=8)\n"
                     "a = p.parse_args()\n"
                     "data = torch.randn(40, 4)\n"
                     "model = torch.nn.Linear(4, 1)\n"
                     "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                     "if a.batch_size > 16:\n"
                     "    raise ValueError('40 rows: no batch above 16')\n"
                     "for i in range(0, 40, a.batch_size):\n"
                     "    (model(data[i:i + a.batch_size]).sum() / a.accum_steps).backward()\n"
                     "    if (i // a.batch_size + 1) % a.accum_steps == 0:\n"
                     "        opt.step()\n"
                     "        opt.zero_grad()\n")
    result = diagnose(tmp_path, small, [])
    assert result.returncode == 3
    error = result.record["error"]
    assert "the script run with the reference's arguments (--accum-steps 1 --batch-size 32)" \
        in error["message"] and "no batch above 16" in error["message"]
    assert "With your own arguments it reaches its first step" in error["message"]
    assert error["location"]["line"] == 11


def test_k_equal_to_the_micro_batch_and_no_average_is_named_not_a_crash(tmp_path):
    """K = b = 4: "not divided by K" and "summed over the micro-batch" give the same 4x; a
    spec re-splits the window to tell them apart, a script cannot (its first match stays).
    Was an internal error (exit 4) in script mode."""
    result = diagnose(tmp_path, AMP, ["--amp", "--accum-steps", "4", "--batch-size", "4",
                                      "--bug", "no-average"])
    assert result.returncode == 1, result.stderr
    (finding,) = result.record["findings"]
    assert (finding["kind"], finding["rung"]) == ("missing-accumulation-average", "fp32-accum")
    assert finding["evidence"]["ratio"] == pytest.approx(4.0, rel=1e-3)


def test_a_script_that_ends_before_stepping_says_how_it_ended(tmp_path):
    ends = tmp_path / "ends.py"
    ends.write_text("import sys\nimport torch\nmodel = torch.nn.Linear(4, 1)\n"
                    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                    "model(torch.randn(2, 4)).sum().backward()\nsys.exit(0)\n")
    result = diagnose(tmp_path, ends, [], None, "--no-reference")
    assert result.returncode == 3
    assert result.record["error"]["message"] == (
        "the script ran 1 forward(s) of its model and 1 backward(s) but never stepped its "
        "optimizer: it called sys.exit(0)")
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\nmodel = torch.nn.Linear(4, 1)\n")
    result = diagnose(tmp_path, plain, [], None, "--no-reference")
    assert result.returncode == 3
    assert result.record["error"]["message"].startswith(
        "the script ran to its end without building a torch.optim optimizer")


def test_init_proposes_the_script_mode_command_and_it_runs(tmp_path):
    result = run_cli("init", LOADER, "-o", tmp_path / "triage.yaml")
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip()
    assert command == (f"ampdoctor diagnose {LOADER} --reference-args "
                       "'--grad-accum 1 --batch-size 32' --")
    assert "--grad-accum defaults to 4, --batch-size to 8" in " ".join(result.stderr.split())
    words = shlex.split(command)[1:]
    run = run_cli(*words[:2], "--json", "--out", tmp_path / "runs", *words[2:])
    assert run.returncode == 0, run.stderr
    assert run.record["findings"] == [] and run.record["accumulation_steps"] == 4


def test_init_fills_the_spec_from_the_option_defaults(tmp_path):
    assert run_cli("init", AMP, "-o", tmp_path / "a.yaml").returncode == 0
    spec = yaml.safe_load((tmp_path / "a.yaml").read_text())
    assert (spec["accumulation_steps"], spec["micro_batch_size"], spec["max_grad_norm"]) == (
        4, 8, 1.0)
    assert spec["optimizer"] == {"name": "SGD", "lr": 0.05}   # lr=args.lr: --lr's default
    result = run_cli("init", NANOGPT, "-o", tmp_path / "n.yaml")
    assert "--reference-args '--gradient_accumulation_steps=1 --batch_size=16' --" in \
        result.stdout
    nanogpt = yaml.safe_load((tmp_path / "n.yaml").read_text())
    assert nanogpt["micro_batch_size"] == 4
    assert nanogpt["optimizer"] == {"name": "AdamW", "lr": 0.006}   # lr=learning_rate


def test_a_run_past_its_time_bound_is_stopped_exit_3(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import time\n"
                      "import torch\n"
                      "model = torch.nn.Linear(2, 1)\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "model(torch.ones(1, 2)).sum().backward()\n"
                      "opt.step()\n"
                      "time.sleep(60)\n")
    result = run_cli("diagnose", script, "--json", "--out", tmp_path / "runs",
                     "--no-reference", env={"AMPDOCTOR_SCRIPT_TIMEOUT_S": "2"})
    assert result.returncode == 3
    assert "did not reach its last step within 2 s" in result.record["error"]["message"]
    bad = run_cli("diagnose", script, "--out", tmp_path / "runs", "--no-reference",
                  env={"AMPDOCTOR_SCRIPT_TIMEOUT_S": "soon"})
    assert bad.returncode == 2 and "AMPDOCTOR_SCRIPT_TIMEOUT_S" in bad.stderr


@pytest.mark.parametrize("reference, said", [
    ("--accum-steps 4 --batch-size 32", "accumulated 4 micro-batches"),
    ("--accum-steps 1 --batch-size 8", "read 8 row(s)"),
], ids=["reference-accumulates", "reference-batch-too-small"])
def test_reference_args_that_are_not_the_full_batch_are_exit_2(tmp_path, reference, said):
    result = diagnose(tmp_path, AMP, ["--amp"], reference)
    assert result.returncode == 2
    assert said in result.record["error"]["message"]
    assert "ampdoctor: usage error:" in result.stderr and "--reference-args" in result.stderr


def test_without_reference_args_the_reference_is_inferred_and_said(tmp_path):
    result = diagnose(tmp_path, AMP, ["--amp", "--bug", "no-average"], None, "--rungs",
                      "fp32-accum")
    assert result.returncode == 1, result.stderr
    record = result.record
    assert record["reference_args"] == ["--amp", "--bug", "no-average", "--accum-steps", "1",
                                        "--batch-size", "32"]
    assert record["reference_args_origin"] == "inferred"
    assert "reference: --amp --bug no-average --accum-steps 1 --batch-size 32 (inferred: " \
        "--accum-steps 4 (default) -> 1, --batch-size 8 (default) -> 32)" in result.stderr
    assert any("inferred from the script's options" in n for n in record["notes"])
    first = record["findings"][0]
    assert (first["kind"], first["location"]["line"]) == (
        "missing-accumulation-average", marked_line(AMP, "missing-accumulation-average"))


def test_a_reference_that_cannot_be_inferred_is_exit_2_with_the_command_to_try(tmp_path):
    script = tmp_path / "fixed_k.py"
    script.write_text("import torch\nK = 4\nmodel = torch.nn.Linear(2, 1)\n")
    result = run_cli("diagnose", script, "--out", tmp_path / "runs")
    assert result.returncode == 2
    assert "cannot infer the reference" in result.stderr
    assert "--reference-args" in result.stderr and "--no-reference" in result.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*.json"))


@pytest.mark.parametrize("args, exit_code, severity", [
    (["--growth-interval", "1"], 0, "warning"),
    (["--precision", "fp16", "--growth-interval", "1"], 1, "error")],
    ids=["trains-in-bf16", "trains-in-fp16"])
def test_a_forced_fp16_rungs_skips_never_fail_a_script_without_a_scaler(tmp_path, args,
                                                                       exit_code, severity):
    """The same script, its scaler keeping on skipping in fp16 and its scheduler advancing on
    every skip: trained in bf16 (the GradScaler built disabled) the skips rung forced fp16 onto
    it, so what it finds is a warning about fp16; trained in fp16 it is that run's error."""
    result = diagnose(tmp_path, BF16, args, "--accum-steps 1 --batch-size 32", "--steps", "8")
    assert result.returncode == exit_code, result.stderr
    record = result.record
    finding = next(f for f in record["findings"] if f["kind"] == "scheduler-steps-on-skip")
    assert (finding["rung"], finding["severity"]) == ("skips", severity)
    assert finding["location"]["line"] == marked_line(BF16, "scheduler-steps-on-skip")
    assert finding["evidence"]["own_precision_scaled"] is (severity == "error")
    assert finding["evidence"]["steady_skips"] >= 2
    frequent = next(f for f in record["findings"] if f["kind"] == "frequent-skips")
    assert frequent["severity"] == severity
    if severity == "warning":
        assert record["verdict"] == "healthy"
        assert "this is what it would do in fp16" in finding["message"]
    else:
        assert record["failed_rung"] == "skips"


def test_an_epoch_s_partial_last_window_is_no_off_by_one(tmp_path):
    """5 micro-batches with K = 2 make windows of 2, 2, 1: the short last window is an epoch's
    remainder, not an off-by-one condition. Its reference (batch 32) ends after 2 steps: exit 2
    saying which --steps compares the windows both have; with it, healthy."""
    script = RECIPES / "scripts" / "partial_last_window.py"
    reference = "--use-amp --grad-accumulation-steps 1 --train-batch-size 32"
    result = diagnose(tmp_path, script, ["--use-amp"], reference)
    assert result.returncode == 2, result.stderr
    assert "ended after 2 optimizer step(s)" in result.stderr and "--steps 2" in result.stderr
    assert "off by one" not in result.stdout + result.stderr
    result = diagnose(tmp_path, script, ["--use-amp"], reference, "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy" and result.record["findings"] == []


@pytest.mark.parametrize("args, warned", [
    (["--bug", "scaler-always-on"], True),
    ([], False),                                               # enabled for fp16 only
    (["--amp-dtype", "float16", "--bug", "scaler-always-on"], False),   # fp16 needs it
], ids=["bf16-scaler-on", "bf16-scaler-off", "fp16-scaler-on"])
def test_a_scaler_the_script_enables_for_its_bf16_training_is_half_open(tmp_path, args, warned):
    """The bf16 rung forces the script's scaler off, so it judges the script as written from
    what its fp32 run recorded (autocast bfloat16, a GradScaler it enables): the same
    half-open-amp warning spec mode gives a bf16 run with a scaler, at the GradScaler line."""
    result = diagnose(tmp_path, FINETUNE, args, " ".join([FINETUNE_REF, *args]))
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy"
    if not warned:
        assert record["findings"] == []
        assert statuses(record)["bf16-no-scaler"] == "pass"
        return
    assert "GradScaler, autocast bf16" in record["found"]["text"]
    [finding] = record["findings"]
    assert (finding["rung"], finding["kind"], finding["severity"]) == (
        "bf16-no-scaler", "half-open-amp", "warning")
    assert Path(finding["location"]["file"]).resolve() == FINETUNE.resolve()
    assert finding["location"]["line"] == marked_line(FINETUNE, "half-open-amp")
    assert finding["evidence"]["scale"] == 65536.0
    assert statuses(record)["bf16-no-scaler"] == "warn"
    assert all(s in ("pass", "skip") for r, s in statuses(record).items()
               if r != "bf16-no-scaler")
