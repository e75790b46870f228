"""Script mode names a mismatch as sharply as spec mode (issue 34 item 6): with per-micro-batch
references (the script run with its reference's arguments and the batch option set to the
micro-batch, `script.references`) the rules build the same hypotheses as a spec's
loop-as-reference. Each case is an unmodified script of recipes/scripts/ run through the real
CLI, with its healthy twin clean."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RECIPES, marked_line, run_cli

SCRIPTS = RECIPES / "scripts"
AMP = SCRIPTS / "amp_recipe.py"
RAGGED = SCRIPTS / "ragged_lm.py"

pytestmark = pytest.mark.xdist_group("script_mode")


def diagnose(tmp_path: Path, script: Path, args: list[str], reference: str):
    return run_cli("diagnose", script, "--json", "--out", tmp_path / "runs",
                   "--reference-args", reference, "--", *args)


def first_error(record: dict) -> dict:
    return next(f for f in record["findings"] if f["severity"] == "error")


def test_ragged_tokens_averaged_per_micro_batch_are_a_weighted_average_mismatch(tmp_path):
    result = diagnose(tmp_path, RAGGED, [], "--grad-accum 1 --batch-size 8")
    assert result.returncode == 1, result.stderr
    found = first_error(result.record)
    assert (found["rung"], found["kind"]) == ("fp32-accum", "weighted-average-mismatch")
    assert found["location"]["line"] == marked_line(RAGGED, "weighted-average-mismatch")
    evidence = found["evidence"]
    assert evidence["weights"] == [0.25] * 4            # what the run did: equal
    # what the reference implies: each micro-batch's share of the window's real tokens
    assert "IGNORE, VOCAB, MAX_LEN = -100, 50, 32" in RAGGED.read_text()
    tokens = _window_tokens()
    assert evidence["reference_weights"] == pytest.approx([t / sum(tokens) for t in tokens],
                                                          abs=1e-3)
    assert "the reference implies" in found["message"]


def _window_tokens() -> list[int]:
    """The real tokens of the first window's 4 micro-batches of 2 texts, drawn as the script
    draws its corpus lengths (its generator, seed 3)."""
    import torch
    g = torch.Generator().manual_seed(3)
    lengths: list[int] = []
    for _ in range(2 * 4):
        base = int(torch.randint(2, 30, (1,), generator=g))
        lengths += [base, max(1, base - int(torch.randint(0, 3, (1,), generator=g)))]
    return [lengths[2 * k] + lengths[2 * k + 1] for k in range(4)]


def test_ragged_tokens_averaged_over_the_window_are_clean(tmp_path):
    result = diagnose(tmp_path, RAGGED, ["--loss-average", "window", "--amp"],
                      "--grad-accum 1 --batch-size 8 --loss-average window --amp")
    assert result.returncode == 0, result.stderr
    assert result.record["findings"] == []
    assert {r["id"]: r["status"] for r in result.record["rungs"]}["fp32-accum"] == "pass"


@pytest.mark.parametrize("bug, clip, kind", [
    ("double-average", "0.5", "double-average"),      # the clip bites on the run's steps
    ("reduction-sum", "100", "reduction-mismatch"),
], ids=["double-average-biting-clip", "reduction-sum"])
def test_size_factors_are_named_as_in_spec_mode(tmp_path, bug, clip, kind):
    args = ["--amp", "--bug", bug, "--max-grad-norm", clip]
    result = diagnose(tmp_path, AMP, args, "--accum-steps 1 --batch-size 32 " + " ".join(args))
    assert result.returncode == 1, result.stderr
    found = first_error(result.record)
    assert (found["rung"], found["kind"]) == ("fp32-accum", kind)
    assert found["location"]["line"] == marked_line(AMP, kind)
    # the consumed gradient before the clip: a quarter of the reference's (K = 4)
    assert found["evidence"]["measured"] == pytest.approx(0.25, rel=1e-3)
    if kind == "double-average":
        assert found["evidence"]["factor"] == pytest.approx(0.25)


GAN = SCRIPTS / "gan.py"


def test_two_models_two_optimizers_are_judged_each(tmp_path):
    """A GAN's two losses backward per micro-batch: K is its micro-batches (not its backwards),
    the reference's batch K x b is accepted, and both optimizers' steps are compared."""
    from ampdoctor.script.infer import infer_reference
    reference = infer_reference(str(GAN), [])
    assert reference.args == ["--accum", "1", "--batch-size", "32"]
    result = diagnose(tmp_path, GAN, [], " ".join(reference.args))
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["findings"] == [] and record["accumulation_steps"] == 4
    assert len(record["found"]["models"]) == 2 and record["found"]["optimizers"] == ["Adam"] * 2
    fp32 = next(r for r in record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["summary"].startswith("6 optimizer steps match")   # 3 windows x 2 optimizers


@pytest.mark.parametrize("bug, optimizer", [("g-no-average", 0), ("d-no-average", 1)])
def test_a_gan_bug_is_named_at_the_loss_of_its_own_model(tmp_path, bug, optimizer):
    result = diagnose(tmp_path, GAN, ["--bug", bug], f"--accum 1 --batch-size 32 --bug {bug}")
    assert result.returncode == 1, result.stderr
    found = first_error(result.record)
    assert (found["rung"], found["kind"]) == ("fp32-accum", "missing-accumulation-average")
    line = next(n for n, text in enumerate(GAN.read_text().splitlines(), 1)
                if f"# BUG: missing-accumulation-average (with --bug {bug})" in text)
    assert found["location"]["line"] == line
    assert found["evidence"]["optimizer"] == optimizer   # opt_g is built first
    assert found["evidence"]["measured"] == pytest.approx(4.0, rel=1e-3)


ACCELERATE = SCRIPTS / "accelerate_loop.py"


@pytest.mark.parametrize("bug", ["none", "double-average"])
def test_an_accelerate_script_gets_the_fix_in_accelerate_terms(tmp_path, bug):
    """`accelerator.backward` divides by K inside `accelerator.accumulate()`: the loop's own
    division is the one to remove (the fix says so, as in spec mode), and the healthy script
    is clean."""
    pytest.importorskip("accelerate")
    result = run_cli("diagnose", ACCELERATE, "--json", "--out", tmp_path / "runs", "--",
                     "--bug", bug)
    record = result.record
    assert record["reference_args"] == ["--bug", bug, "--gradient_accumulation_steps", "1",
                                        "--per_device_train_batch_size", "32"]
    if bug == "none":
        assert result.returncode == 0, result.stderr
        assert record["findings"] == []
        return
    assert result.returncode == 1, result.stderr
    found = first_error(record)
    assert (found["rung"], found["kind"]) == ("fp32-accum", "double-average")
    assert found["location"]["line"] == marked_line(ACCELERATE, "double-average")
    assert found["evidence"]["measured"] == pytest.approx(0.25, rel=1e-3)
    assert found["evidence"]["framework"] == "accelerate"
    assert "already divides" in found["message"]
    assert found["fix"].startswith("Remove your own division")
    assert "keep `loss" not in found["fix"]
