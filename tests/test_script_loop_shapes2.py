"""Script mode on more loop shapes, end to end through the real CLI (the second hunt):

- an epoch's short last window (n < K micro-batches) whose loss is divided by K like every
  window: its update is n/K of the window's mean, each micro-batch weighing 1/K -- the
  convention of most loops and of accelerate's `backward`. Healthy, with a note naming the
  step and n/K (before: `double-average` "averaged twice" when n = 1, a varying divisor when
  n = 2);
- windows numbered by the reference's windows, not `i // K`: after several epochs with a short
  window each, the healthy loop is healthy (before: step 5 read as window 4, gradient-mismatch);
- a short window that never steps (no `last_batch` update): zero-grad-inside-accumulation
  judged against that window with its real count of micro-batches (before: "4 of 4");
- an argparse prefix the script's parser would refuse (`--b` for `--batch-size` and `--beta`,
  or any prefix under `allow_abbrev=False`): exit 2 naming the flag and argparse's message
  (before: exit 3 blaming the reference's arguments).
"""

from __future__ import annotations

import pytest

from conftest import RECIPES, marked_line, run_cli
from test_script_loop_shapes import compared, diagnose

TIMM = RECIPES / "scripts" / "timm_epoch.py"
AMBIGUOUS = RECIPES / "scripts" / "ambiguous_prefix.py"
pytestmark = pytest.mark.xdist_group("script_mode")


@pytest.mark.parametrize(("rows", "steps", "n"), [(100, 4, 1), (80, 3, 2)])
def test_short_last_window_divided_by_k_is_the_convention_and_said(tmp_path, rows, steps, n):
    result = diagnose(tmp_path, TIMM, "--amp", "--clip-grad", "1.0", "--bug",
                      "last-window-full-k", "--rows", str(rows), steps=steps)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert compared(record) == steps
    note = next(x for x in record["notes"] if "short window" in x)
    assert f"step {steps - 1} is an epoch's last, short window of {n} of K=4" in note
    assert f"its update is {n}/4 of that window's mean" in note


def test_windows_after_several_short_ones_keep_their_numbers(tmp_path):
    """80 rows, micro-batches of 8, K = 4: windows of 4, 4, 2 every epoch; 6 steps over two
    epochs step after micro-batches 3, 7, 9, 13, 17, 19: windows 0-5, not 19 // 4 = 4."""
    result = diagnose(tmp_path, TIMM, "--amp", "--rows", "80", "--epochs", "3", steps=6)
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy" and result.record["findings"] == []
    assert compared(result.record) == 6


@pytest.mark.parametrize(("rows", "window", "size"), [(88, 2, 3), (100, 3, 1)])
def test_unstepped_short_window_says_its_real_numbers(tmp_path, rows, window, size):
    result = diagnose(tmp_path, TIMM, "--amp", "--bug", "no-last-update", "--rows", str(rows),
                      steps=4)
    assert result.returncode == 1, result.stderr
    errors = [f for f in result.record["findings"] if f["severity"] == "error"]
    assert len(errors) == 1, result.record["findings"]
    finding = errors[0]
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "zero-grad-inside-accumulation")
    assert finding["location"]["line"] == marked_line(
        TIMM, "zero-grad-inside-accumulation (with --bug no-last-update")
    evidence = finding["evidence"]
    assert (evidence["step"], evidence["window"]) == (window, window)
    assert (evidence["measured"], evidence["expected"]) == (0, size)
    assert evidence["window_microbatches"] == size
    assert (f"Window {window}, an epoch's last, short window of {size} micro-batch(es) (K=4)"
            in finding["message"])


def test_timm_short_window_over_its_own_count_over_epochs_is_healthy(tmp_path):
    result = diagnose(tmp_path, TIMM, "--amp", "--clip-grad", "1.0", "--rows", "88",
                      "--epochs", "3", steps=6)
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy" and result.record["findings"] == []
    assert not any("short window" in x for x in result.record["notes"])
    assert compared(result.record) == 6


@pytest.mark.parametrize(("args", "said"), [
    (["--b", "4"], "ambiguous option: --b could match --batch-size, --beta"),
    (["--b=4"], "ambiguous option: --b=4 could match --batch-size, --beta"),
])
def test_an_ambiguous_argparse_prefix_is_the_users_arguments(tmp_path, args, said):
    result = run_cli("diagnose", AMBIGUOUS, "--out", tmp_path / "runs", "--", "--amp", *args)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert "--b is not one of ambiguous_prefix.py's options" in result.stderr
    assert "reference's arguments" not in result.stderr and "Traceback" not in result.stderr


def test_a_unique_prefix_still_runs_and_a_refused_one_is_exit_2(tmp_path):
    result = run_cli("diagnose", AMBIGUOUS, "--json", "--out", tmp_path / "runs", "--steps",
                     "2", "--", "--amp", "--bat", "4")
    assert result.returncode == 0, result.stderr
    assert result.record["micro_batch_size"] == 4
    strict = tmp_path / "strict.py"
    strict.write_text(AMBIGUOUS.read_text().replace(
        "argparse.ArgumentParser()", "argparse.ArgumentParser(allow_abbrev=False)"))
    result = run_cli("diagnose", strict, "--out", tmp_path / "runs", "--", "--bat", "4")
    assert result.returncode == 2, result.stderr
    assert "unrecognized arguments: --bat" in result.stderr
    assert "allow_abbrev=False" in result.stderr


GLUE = RECIPES / "scripts" / "glue_no_trainer.py"


@pytest.mark.parametrize("steps", [3, 5])
def test_accelerate_no_trainer_loop_with_a_short_epoch_end_is_healthy(tmp_path, steps):
    """run_glue_no_trainer's loop: accelerate syncs at the dataloader's end and divides the
    short window (3 of K = 4 batches) by K. Before: reduction-mismatch at step 2, an error on
    the loop accelerate's documentation writes."""
    result = diagnose(tmp_path, GLUE, steps=steps)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    assert compared(record) == steps
    assert any("step 2 is an epoch's last, short window of 3 of K=4" in n
               for n in record["notes"])


def test_accelerate_scheduler_left_unprepared_is_scheduler_per_microbatch(tmp_path):
    result = diagnose(tmp_path, GLUE, "--bug", "sched-unprepared")
    assert result.returncode == 1, result.stderr
    finding = next(f for f in result.record["findings"] if f["severity"] == "error")
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "scheduler-per-microbatch")
    assert finding["location"]["line"] == marked_line(GLUE, "scheduler-per-microbatch")
    assert finding["evidence"]["measured"] == 4


def test_a_clip_on_every_micro_batch_is_named_at_the_clip(tmp_path):
    """`accelerator.clip_grad_norm_` outside the `sync_gradients` gate clips each partial sum:
    no known shape, but the finding stands at the clip and says it clipped before the last
    backward (before: at optimizer.step, with nothing said)."""
    result = diagnose(tmp_path, GLUE, "--bug", "clip-every-mb", "--max_grad_norm", "0.05")
    assert result.returncode == 1, result.stderr
    finding = next(f for f in result.record["findings"] if f["severity"] == "error")
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "gradient-mismatch")
    assert finding["location"]["line"] == marked_line(GLUE, "gradient-mismatch")
    assert finding["evidence"]["early_clips"] == 3 and finding["evidence"]["step"] == 0
    assert "clipped 3 time(s) before its last backward" in finding["message"]


ONECYCLE = RECIPES / "scripts" / "onecycle_window.py"


@pytest.mark.parametrize("steps", [3, 6])
def test_onecycle_per_window_healthy_per_micro_batch_named_even_when_it_raises(tmp_path, steps):
    healthy = diagnose(tmp_path, ONECYCLE, "--amp", steps=steps)
    assert healthy.returncode == 0, healthy.stderr
    assert healthy.record["verdict"] == "healthy" and healthy.record["findings"] == []
    # per micro-batch: 16 total steps, the 17th scheduler step (in the 5th window) raises;
    # with --steps 3 the run stops before it
    result = diagnose(tmp_path, ONECYCLE, "--amp", "--bug", "sched-per-mb", steps=steps)
    assert result.returncode == 1, result.stderr
    record = result.record
    assert record["verdict"] == "failed"
    [finding] = record["findings"]
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "scheduler-per-microbatch")
    assert finding["location"]["line"] == marked_line(ONECYCLE, "scheduler-per-microbatch")
    assert finding["evidence"]["measured"] == 4
    assert finding["evidence"]["optimizer_steps"] == (3 if steps == 3 else 4)


def test_arguments_the_scripts_parser_refuses_are_the_users(tmp_path):
    """An option the script does not have, after `--` (here ampdoctor's own --out put on the
    wrong side): exit 2 with argparse's message, not exit 3 blaming the reference."""
    result = run_cli("diagnose", AMBIGUOUS, "--", "--out", str(tmp_path / "runs"))
    assert result.returncode == 2, result.stderr
    assert "unrecognized arguments: --out" in result.stderr
    assert "the script's arguments (--out" in result.stderr
    assert "Fix the arguments after `--`" in result.stderr
    bad_ref = run_cli("diagnose", AMBIGUOUS, "--out", tmp_path / "runs", "--reference-args",
                      "--batch-size 32 --accum-steps 1 --nope", "--")
    assert bad_ref.returncode == 2, bad_ref.stderr
    assert "the reference's arguments (--batch-size 32 --accum-steps 1 --nope)" in bad_ref.stderr


CLM = RECIPES / "scripts" / "clm_no_trainer.py"


@pytest.mark.parametrize("bug", ["none", "loss-over-k"])
def test_clm_no_trainer_loop_short_end_healthy_and_its_extra_division_named(tmp_path, bug):
    """run_clm_no_trainer's loop on a tiny GPT-2: 15 batches, windows 4, 4, 4, 3; the last
    divided by K by accelerate (before: reduction-mismatch at step 3). Divided by K again in
    the loop: double-average at the backward, in accelerate's terms."""
    result = diagnose(tmp_path, CLM, "--bug", bug, steps=4)
    if bug == "none":
        assert result.returncode == 0, result.stderr
        assert result.record["verdict"] == "healthy" and result.record["findings"] == []
        assert compared(result.record) == 4
        assert any("step 3 is an epoch's last, short window of 3 of K=4" in n
                   for n in result.record["notes"])
        return
    assert result.returncode == 1, result.stderr
    errors = [f for f in result.record["findings"] if f["severity"] == "error"]
    assert len(errors) == 1, result.record["findings"]
    finding = errors[0]
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "double-average")
    assert finding["location"]["line"] == marked_line(CLM, "double-average")
    assert finding["evidence"]["step"] == 0
    assert abs(finding["evidence"]["measured"] - 0.25) < 1e-3
    assert "accelerator.backward" in finding["message"]


CARRY = RECIPES / "scripts" / "epoch_carry.py"


def test_a_short_window_carried_into_the_next_epoch_is_named(tmp_path):
    """Stepping on `(i + 1) % K == 0` alone, zero_grad only after a step: the epoch's last 3
    micro-batches ride into the next epoch's first step (7 micro-batches / K). Before:
    gradient-mismatch 'matching no known mistake'; now said, checked against the two
    windows' references summed at 1/K each. With the last-batch step: healthy."""
    fixed = diagnose(tmp_path, CARRY, "--fix", steps=4)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.record["verdict"] == "healthy" and fixed.record["findings"] == []
    result = diagnose(tmp_path, CARRY, steps=4)
    assert result.returncode == 1, result.stderr
    errors = [f for f in result.record["findings"] if f["severity"] == "error"]
    assert len(errors) == 1, result.record["findings"]
    finding = errors[0]
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "gradient-mismatch")
    assert finding["location"]["line"] == marked_line(CARRY, "gradient-mismatch")
    evidence = finding["evidence"]
    assert (evidence["step"], evidence["window"]) == (2, 2)
    assert (evidence["window_microbatches"], evidence["contributing_microbatches"]) == (3, 7)
    assert "Window 2, an epoch's last, short window of 3 micro-batch(es) (K=4)" in \
        finding["message"]
