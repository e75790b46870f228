"""Script mode on loop shapes of popular repositories (recipes/scripts/mae_finetune.py: MAE's
fine-tuning epoch; recipes/scripts/timm_epoch.py: timm's), healthy and broken, end to end
through the real CLI: kind, rung, numbers and the script's line.

- MAE sets its rate by hand from a fractional epoch. Set on every micro-batch from that same
  fraction, each step uses the rate of its window's last micro-batch, less than a step of the
  schedule later: harmless, as in a spec (it crashed the rung before). Counted in micro-batches
  over optimizer steps, the warm-up runs K times too fast: scheduler-per-microbatch at the line
  that assigns the rate.
- timm divides the epoch's last, partial window by its own count. A run stopped after the
  partial window reads on into the next epoch's first window: that is no step per micro-batch,
  the data lines up with the reference's short last batch, and the partial window is compared.
  Divided by K instead (the usual convention), its update is n/K of its window's mean: healthy,
  with a note (tests/test_script_loop_shapes2.py). A warm-up counted in
  micro-batches but set once per update parts from the reference after the first step: the
  schedule's pace, at the line that assigns the rate (not the optimizer's).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import RECIPES, marked_line, run_cli

MAE = RECIPES / "scripts" / "mae_finetune.py"
TIMM = RECIPES / "scripts" / "timm_epoch.py"
pytestmark = pytest.mark.xdist_group("script_mode")


def diagnose(tmp_path: Path, script: Path, *args: str, steps: int = 3):
    return run_cli("diagnose", script, "--json", "--out", tmp_path / "runs", "--steps",
                   str(steps), "--", *args)


def compared(record: dict) -> int:
    fp32 = next(r for r in record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["status"] == "pass", fp32
    return fp32["details"]["steps_compared"]


def the_error(record: dict) -> dict:
    errors = [f for f in record["findings"] if f["severity"] == "error"]
    assert len(errors) == 1, record["findings"]
    return errors[0]


@pytest.mark.parametrize("bug", ["none", "lr-every-iter"])
def test_mae_rate_set_per_window_or_from_the_same_fraction_is_healthy(tmp_path, bug):
    result = diagnose(tmp_path, MAE, "--amp", "--clip_grad", "1.0", "--bug", bug)
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy" and result.record["findings"] == []
    assert compared(result.record) == 3


def test_mae_warmup_counted_in_micro_batches_is_scheduler_per_microbatch(tmp_path):
    result = diagnose(tmp_path, MAE, "--amp", "--clip_grad", "1.0", "--bug", "warmup-per-iter")
    assert result.returncode == 1, result.stderr
    finding = the_error(result.record)
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "scheduler-per-microbatch")
    assert finding["location"]["line"] == marked_line(MAE, "scheduler-per-microbatch")
    assert Path(finding["location"]["file"]).resolve() == MAE.resolve()
    # K = 4 micro-batches of 8 over 512 rows: 64 micro-batches, 16 optimizer steps an epoch;
    # the rate is blr * 32 / 256 warmed up over one epoch. Step 0 used the rate of micro-batch
    # 3 read as step 3 (3/16 of the warm-up); the reference's step 0 has 0.
    lr = 1e-3 * 32 / 256
    evidence = finding["evidence"]
    assert evidence["measured"] == 4 and evidence["first_step_off"] == 0
    assert math.isclose(evidence["lr_used"], lr * 3 / 16, rel_tol=1e-5)
    assert evidence["lr_expected"] == 0


def test_timm_partial_last_window_is_compared_and_healthy(tmp_path):
    result = diagnose(tmp_path, TIMM, "--amp", "--clip-grad", "1.0", steps=4)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert record["accumulation_steps"] == 4 and record["micro_batch_size"] == 8
    assert compared(record) == 4


def test_timm_partial_window_left_unstepped_is_zeroed_inside_a_window(tmp_path):
    """Without the last-batch update the partial window never steps: the next epoch's
    zero_grad wipes its micro-batch, and step 3 consumed the next epoch's first window where
    the reference's step 3 holds the 4 last rows. Step 3 must be judged (a run that reads on
    past its partial window is not cut short there), or the run passes as healthy."""
    result = diagnose(tmp_path, TIMM, "--amp", "--bug", "no-last-update", steps=4)
    assert result.returncode == 1, result.stderr
    finding = the_error(result.record)
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "zero-grad-inside-accumulation")
    assert finding["location"]["line"] == marked_line(
        TIMM, "zero-grad-inside-accumulation (with --bug no-last-update")
    assert "Window 3, an epoch's last, short window of 1 micro-batch" in finding["message"]
    assert finding["evidence"]["step"] == 3
    assert (finding["evidence"]["measured"], finding["evidence"]["expected"]) == (0, 1)


def test_timm_warmup_counted_in_micro_batches_is_named_at_the_assignment(tmp_path):
    result = diagnose(tmp_path, TIMM, "--amp", "--bug", "updates-per-batch")
    assert result.returncode == 1, result.stderr
    finding = the_error(result.record)
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "gradient-mismatch")
    assert finding["location"]["line"] == marked_line(
        TIMM, "gradient-mismatch (with --bug updates-per-batch")
    assert "linear scaling rule" not in finding["message"]
    # warm-up over 5 updates, rate (n + 1) / 6 of 0.05 after n updates: at step 1 the run has
    # counted 4 micro-batches as updates, the reference 1
    evidence = finding["evidence"]
    assert evidence["step"] == 1
    assert math.isclose(evidence["lr_used"], 0.05 * 5 / 6, rel_tol=1e-5)
    assert math.isclose(evidence["lr_expected"], 0.05 * 2 / 6, rel_tol=1e-5)
    assert math.isclose(evidence["measured"], 2.5, rel_tol=1e-5)


LIGHTNING = RECIPES / "scripts" / "lightning_bf16.py"


def test_lightning_module_calling_a_submodule_is_healthy(tmp_path):
    """The micro-batch forward is the outermost forward of a module holding the optimizer's
    parameters (here `self.net`, the LightningModule's own forward never runs), and the
    reference's gradient is read after the closure Lightning hands `optimizer.step` has run
    (before: no micro-batch was seen, the run never stopped, step-per-microbatch; then a
    reference gradient of zero)."""
    pytest.importorskip("lightning")
    result = diagnose(tmp_path, LIGHTNING)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert record["accumulation_steps"] == 4 and record["micro_batch_size"] == 8
    assert compared(record) == 3
    assert record["reference_args"] == ["--accumulate_grad_batches", "1", "--batch_size", "32"]


def test_lightning_module_dividing_by_k_again_is_double_average(tmp_path):
    pytest.importorskip("lightning")
    result = diagnose(tmp_path, LIGHTNING, "--bug", "divide-by-k")
    assert result.returncode == 1, result.stderr
    finding = the_error(result.record)
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "double-average")
    assert finding["location"]["line"] == marked_line(LIGHTNING, "double-average")
    assert Path(finding["location"]["file"]).resolve() == LIGHTNING.resolve()
    assert math.isclose(finding["evidence"]["measured"], 0.25, rel_tol=1e-3)
    assert "accumulate_grad_batches" in finding["message"]


NAN_DATA = RECIPES / "scripts" / "nan_data.py"


@pytest.mark.parametrize("bug", ["none", "nan-row"])
def test_a_script_whose_fp32_training_diverges_is_exit_3_not_unrepeatable(tmp_path, bug):
    """A NaN in the data makes both fp32 runs NaN: before, `nondeterministic-baseline` (two
    NaN gradients compare as different) blaming the seeded data line; now exit 3 saying the
    baseline diverges, at the backward, as a spec's non-finite reference is."""
    result = diagnose(tmp_path, NAN_DATA, "--amp", "--bug", bug)
    if bug == "none":
        assert result.returncode == 0, result.stderr
        assert result.record["verdict"] == "healthy"
        return
    assert result.returncode == 3, result.stderr
    assert "not finite" in result.stderr and "diverges" in result.stderr
    assert "Traceback" not in result.stderr
    record = result.record
    assert record["verdict"] == "error" and record["findings"] == []
    where = record["error"]["location"]
    assert Path(where["file"]).resolve() == NAN_DATA.resolve()
    assert where["line"] == marked_line(NAN_DATA, "not finite")


def test_a_batch_option_without_a_k_option_says_how_to_give_a_derived_k(tmp_path):
    """YOLOv5 derives K from its batch option (`accumulate = round(nbs / batch_size)`): no K
    option to set to 1, so the line to try says the batch option alone is the reference's."""
    from ampdoctor.core.errors import UsageError
    from ampdoctor.script.infer import infer_reference
    script = tmp_path / "train.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\n"
                      "p.add_argument('--batch-size', type=int, default=16)\n"
                      "opt = p.parse_args()\naccumulate = max(round(64 / opt.batch_size), 1)\n")
    with pytest.raises(UsageError) as caught:
        infer_reference(str(script), ["--amp"], cwd=str(tmp_path))
    message = str(caught.value)
    assert caught.value.exit_code == 2
    assert "takes --batch-size alone at K x the micro-batch" in message


CUDA_API = RECIPES / "scripts" / "cuda_amp_api.py"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU-only case")
def test_cuda_only_amp_api_on_a_cpu_machine_trains_in_fp32_and_is_said(tmp_path):
    """`torch.cuda.amp.autocast()` on a machine without CUDA enters no autocast on the CPU the
    model runs on: nothing to run in bf16 or fp16 (before: half-open-amp, an error, on a script
    that is the usual fp16 recipe on a GPU)."""
    result = diagnose(tmp_path, CUDA_API, "--amp")
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert compared(record) == 3
    line = next(n for n, text in enumerate(CUDA_API.read_text().splitlines(), 1)
                if "# the autocast line" in text)
    skipped = {r["id"]: r["summary"] for r in record["rungs"] if r["status"] == "skip"}
    for rung in ("bf16-no-scaler", "fp16-scaler"):
        assert f"its autocast is for cuda, at cuda_amp_api.py:{line}" in skipped[rung]


YOLO = RECIPES / "scripts" / "yolo_accumulate.py"


@pytest.mark.parametrize("bug", ["none", "loss-over-k"])
def test_yolo_summed_loss_is_healthy_and_dividing_it_by_k_is_named_so(tmp_path, bug):
    """YOLOv5's loss x batch size is a sum the reference (batch 64, K = 1) sums too: healthy.
    Divided by K it is 1/K of the reference's, and the message says what that means for a
    summed loss (divided where it wants no division), not only for a mean one."""
    result = run_cli("diagnose", YOLO, "--json", "--out", tmp_path / "runs", "--reference-args",
                     f"--amp --batch-size 64 --bug {bug}", "--", "--amp", "--bug", bug)
    if bug == "none":
        assert result.returncode == 0, result.stderr
        assert result.record["verdict"] == "healthy" and result.record["findings"] == []
        assert result.record["accumulation_steps"] == 4
        return
    assert result.returncode == 1, result.stderr
    finding = the_error(result.record)
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "double-average")
    assert finding["location"]["line"] == marked_line(YOLO, "double-average (with --bug loss")
    assert math.isclose(finding["evidence"]["ratio"], 0.25, rel_tol=1e-3)
    assert "is divided by 4 where it wants no division" in finding["message"]
