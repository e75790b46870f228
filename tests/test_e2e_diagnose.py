"""End-to-end: the real CLI on every sample config.

Each broken recipe must fail at the right rung with the right kind, evidence within a stated
band, and the exact file:line its `# BUG:` marker names. Every healthy recipe must pass clean.

Each sample config is diagnosed once per session (`diagnosed`, in this process): the tests that
check one config's record share that run, and its xdist_group keeps them on one worker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, RECIPES, marked_line, run_cli


def _grouped(names):
    """Parameters that run on the worker which diagnoses (and caches) their config; a DDP
    config (2 spawned ranks) is slow."""
    return [pytest.param(n, marks=[pytest.mark.xdist_group(n)]
                         + ([pytest.mark.slow] if n.endswith("_ddp") else []))
            for n in sorted(names)]

HEALTHY = sorted(p.stem for p in CONFIGS.glob("healthy_*.yaml"))

# config -> (rung, kind, evidence key, band, file holding the marker)
BROKEN = {
    "broken_missing_average": ("fp32-accum", "missing-accumulation-average", "measured",
                               (3.99, 4.01), "broken_missing_average.py"),
    # clipping saturates both the 4x gradient and the reference: the pre-clip norm tells
    "broken_missing_average_clipped": ("fp32-accum", "missing-accumulation-average", "measured",
                                       (3.99, 4.01), "broken_missing_average.py"),
    "broken_double_average": ("fp32-accum", "double-average", "measured", (0.249, 0.251),
                              "broken_double_average.py"),
    "broken_reduction_sum": ("fp32-accum", "reduction-mismatch", "measured", (7.99, 8.01),
                             "broken_reduction_sum.py"),
    # dict batches of packed text, per-token losses summed: 4 sequences x 9 shifted targets
    "broken_token_sum_reduction": ("fp32-accum", "reduction-mismatch", "measured", (35.9, 36.1),
                                   "broken_token_sum_reduction.py"),
    # no `loss`, micro-batches of different lengths: the loop's token weighting is found, and
    # the extra / K still shows against it
    "broken_token_window_double_average": ("fp32-accum", "double-average", "measured",
                                           (0.249, 0.251),
                                           "broken_token_window_double_average.py"),
    # K == micro_batch_size: "no average" and "sum reduction" give the same factor; a re-split
    # pass must tell them apart
    "broken_reduction_sum_k_equals_b": ("fp32-accum", "reduction-mismatch", "measured",
                                        (3.99, 4.01), "broken_reduction_sum.py"),
    "broken_missing_average_k_equals_b": ("fp32-accum", "missing-accumulation-average",
                                          "measured", (3.99, 4.01), "broken_missing_average.py"),
    # without `loss` the loop at K = 1 is the reference: its sum reduction makes the K-run 1/K
    "broken_reduction_sum_noloss": ("fp32-accum", "reduction-mismatch", "measured",
                                    (0.249, 0.251), "broken_reduction_sum.py"),
    # a hard-coded divisor (8 for K = 4): right direction, half the size
    "broken_hardcoded_divisor": ("fp32-accum", "double-average", "measured", (0.499, 0.501),
                                 "broken_hardcoded_divisor.py"),
    "broken_weighted_average": ("fp32-accum", "weighted-average-mismatch", "cosine", (0.3, 0.995),
                                "broken_weighted_average.py"),
    "broken_step_per_microbatch": ("fp32-accum", "step-per-microbatch", "measured", (12, 12),
                                   "broken_step_per_microbatch.py"),
    "broken_zero_grad_inside": ("fp32-accum", "zero-grad-inside-accumulation", "measured", (1, 1),
                                "broken_zero_grad_inside.py"),
    "broken_scheduler_per_microbatch": ("fp32-accum", "scheduler-per-microbatch", "measured",
                                        (3.9, 4.4), "broken_scheduler_per_microbatch.py"),
    # noise drawn in the loop, outside the forward: randomness ampdoctor cannot align
    "broken_noise_augmentation": ("reproducibility", "nondeterministic-baseline", "measured",
                                  (1e-3, 10), "broken_noise_augmentation.py"),
    # no catalogue shape: an off-by-one accumulation condition, named with its numbers
    "broken_accumulation_off_by_one": ("fp32-accum", "gradient-mismatch", "measured", (1, 1),
                                       "broken_accumulation_off_by_one.py"),
    # .grad never cleared after a step (entirely, or for the head only): step 1 consumes its
    # own window plus step 0's gradient -- found in fp32, before any skip could show it
    "broken_no_zero_grad": ("fp32-accum", "missing-zero-grad", "parameters_not_cleared",
                            (4, 4), "broken_no_zero_grad.py"),
    "broken_partial_zero_grad": ("fp32-accum", "missing-zero-grad",
                                 "parameters_not_cleared", (2, 2), "broken_partial_zero_grad.py"),
    # a leftover `return` after the first step: 1 optimizer step for 3 windows
    "broken_early_return": ("fp32-accum", "gradient-mismatch", "measured", (1, 1),
                            "broken_early_return.py"),
    # fetch-ahead loops (nanoGPT's prefetch before backward): windows counted by what each
    # forward consumed, so every fp32 kind is still found, at the same line
    "broken_fetch_ahead_missing_average": ("fp32-accum", "missing-accumulation-average",
                                           "measured", (3.99, 4.01),
                                           "broken_fetch_ahead_missing_average.py"),
    "broken_fetch_ahead_double_average": ("fp32-accum", "double-average", "measured",
                                          (0.249, 0.251), "broken_fetch_ahead_double_average.py"),
    "broken_fetch_ahead_reduction_sum": ("fp32-accum", "reduction-mismatch", "measured",
                                         (7.99, 8.01), "broken_fetch_ahead_reduction_sum.py"),
    "broken_fetch_ahead_zero_grad_inside": ("fp32-accum", "zero-grad-inside-accumulation",
                                            "measured", (1, 1),
                                            "broken_fetch_ahead_zero_grad_inside.py"),
    "broken_fetch_ahead_step_per_microbatch": ("fp32-accum", "step-per-microbatch", "measured",
                                               (12, 12),
                                               "broken_fetch_ahead_step_per_microbatch.py"),
    # the rate assigned by hand from a micro-batch counter: 4 values inside each window
    "broken_lr_set_per_microbatch": ("fp32-accum", "scheduler-per-microbatch", "measured",
                                     (3.99, 4.01), "broken_lr_set_per_microbatch.py"),
    "broken_fetch_ahead_scheduler_per_microbatch": (
        "fp32-accum", "scheduler-per-microbatch", "measured", (3.9, 4.4),
        "broken_fetch_ahead_scheduler_per_microbatch.py"),
    "broken_fetch_ahead_no_zero_grad": ("fp32-accum", "missing-zero-grad",
                                        "parameters_not_cleared", (4, 4),
                                        "broken_fetch_ahead_no_zero_grad.py"),
    "broken_fetch_ahead_weighted_average": ("fp32-accum", "weighted-average-mismatch", "cosine",
                                            (0.3, 0.995),
                                            "broken_fetch_ahead_weighted_average.py"),
    "broken_fetch_ahead_off_by_one": ("fp32-accum", "gradient-mismatch", "measured", (1, 1),
                                      "broken_fetch_ahead_off_by_one.py"),
    "broken_fetch_ahead_clip_before_unscale": ("fp16-scaler", "clip-before-unscale", "measured",
                                               (0.9 * 65536, 1.1 * 65536),
                                               "broken_fetch_ahead_clip_before_unscale.py"),
    # autocast hard-coded on in the fp32 run: named at the autocast line, not as a size mismatch
    "broken_autocast_in_fp32": ("fp32-accum", "half-open-amp", "relative_error", (1e-3, 5e-2),
                                "broken_autocast_in_fp32.py"),
    "broken_fetch_ahead_autocast_in_fp32": ("fp32-accum", "half-open-amp", "relative_error",
                                            (1e-3, 5e-2),
                                            "broken_fetch_ahead_autocast_in_fp32.py"),
    # a token count overwritten per micro-batch: the factor varies from step to step
    "broken_token_count_overwritten": ("fp32-accum", "reduction-mismatch", "ratio_spread",
                                       (0.5, 100), "broken_token_count_overwritten.py"),
    # a missing / K under clipping that bites on the loop's 4x gradient: the pre-clip factor
    "broken_missing_average_clip_bites": ("fp32-accum", "missing-accumulation-average",
                                          "measured", (3.99, 4.01), "broken_missing_average.py"),
    "broken_missing_average_clip_bites_loop_only": ("fp32-accum", "missing-accumulation-average",
                                                    "measured", (3.99, 4.01),
                                                    "broken_missing_average.py"),
    # ddp-sync: tests/test_ddp.py
    # fp16-scaler: the state machine and the scale-space shapes
    "broken_clip_before_unscale": ("fp16-scaler", "clip-before-unscale", "measured",
                                   (0.9 * 65536, 1.1 * 65536), "broken_clip_before_unscale.py"),
    # the same clip in two steps, get_total_norm + clip_grads_with_norm_ (accelerate's path)
    "broken_clip_with_total_norm_before_unscale": (
        "fp16-scaler", "clip-before-unscale", "measured", (0.9 * 65536, 1.1 * 65536),
        "broken_clip_with_total_norm_before_unscale.py"),
    # every step at the default init_scale overflows in the slice: rerun from the scale the
    # search reached (65536 / 2^3 = 8192), where the clip in scaled space shows
    "broken_fairseq_default_scale_clip": ("fp16-scaler", "clip-before-unscale", "measured",
                                          (0.9 * 8192, 1.1 * 8192),
                                          "broken_fairseq_default_scale_clip.py"),
    # a hand-made clip from a norm read before unscale_: the update is 1/S of the clipped one
    "broken_manual_clip_scaled_norm": ("fp16-scaler", "clip-before-unscale", "measured",
                                       (0.9 * 65536, 1.1 * 65536),
                                       "broken_manual_clip_scaled_norm.py"),
    "broken_missing_unscale_second_optimizer": ("fp16-scaler", "missing-unscale", "measured",
                                                (0.9 * 65536, 1.1 * 65536),
                                                "broken_missing_unscale_second_optimizer.py"),
    # optimizer.step() instead of scaler.step(): torch refuses the update, the step already
    # applied S x the gradient
    "broken_step_bypasses_scaler": ("fp16-scaler", "missing-unscale", "measured",
                                    (0.9 * 65536, 1.1 * 65536), "broken_step_bypasses_scaler.py"),
    "broken_unscale_twice": ("fp16-scaler", "unscale-twice", "measured", (2, 2),
                             "broken_unscale_twice.py"),
    "broken_clip_after_step": ("fp32-accum", "gradient-mismatch", "measured", (8.7, 8.8),
                               "broken_clip_after_step.py"),
    "broken_backward_unscaled_loss": ("fp16-scaler", "unscale-twice", "measured",
                                      (0.9 / 65536, 1.1 / 65536),
                                      "broken_backward_unscaled_loss.py"),
    "broken_manual_unscale_twice": ("fp16-scaler", "unscale-twice", "measured",
                                    (0.9 / 65536, 1.1 / 65536), "broken_manual_unscale_twice.py"),
    # unscale_ after every backward: refused inside the window, not a missing update
    "broken_unscale_per_microbatch": ("fp16-scaler", "unscale-twice", "measured", (2, 2),
                                      "broken_unscale_per_microbatch.py"),
    "broken_update_per_microbatch": ("fp16-scaler", "update-per-microbatch", "measured", (1, 100),
                                     "broken_update_per_microbatch.py"),
    "broken_double_scaling": ("fp16-scaler", "double-scaling", "extra_factor", (1000, 1050),
                              "broken_double_scaling.py"),
    # an aux loss with a GradScaler of its own, in a module of three loops: the two owners of
    # the spec's loop, located at its first (the sibling loops' scalers are not counted)
    "broken_two_scalers_sibling_loops": ("double-scaling", "double-scaling", "measured", (2, 2),
                                         "broken_two_scalers_sibling_loops.py"),
    # the static scale on its own line: the finding points there, not at backward
    "broken_apex_static_scale": ("fp16-scaler", "double-scaling", "extra_factor", (1000, 1050),
                                 "broken_apex_static_scale.py"),
    "broken_autocast_never": ("fp16-scaler", "half-open-amp", "autocast_enabled", (0, 0),
                              "broken_autocast_never.py"),
    # skips: overflow injection
    "broken_no_zero_grad_after_skip": ("skips", "no-zero-grad-after-skip", "measured", (1, 1),
                                       "broken_no_zero_grad_after_skip.py"),
    # a hand-written overflow guard that `continue`s past update() and zero_grad()
    "broken_overflow_continue": ("skips", "no-zero-grad-after-skip", "measured", (0, 0),
                                 "broken_overflow_continue.py"),
    # growth_interval=1 from 65536: after the first real update the scale grows back into
    # overflow and 3 of the 7 steps that follow are skipped; the scheduler advances on each:
    # measured is that steady skip rate, 3/7
    "broken_scheduler_steps_on_skip": ("skips", "scheduler-steps-on-skip", "measured",
                                       (3 / 7 - 1e-6, 3 / 7 + 1e-6),
                                       "broken_scheduler_steps_on_skip.py"),
    # Skips after the scaler's first real update drop updates the reference makes: an error
    # (they were warnings while every skip was judged alike). Here the 6 leading skips are the
    # search down from 2**24 (not counted) and the one step after the first update is skipped
    # right after a growth at growth_interval=1 (a sawtooth: one such skip is frequent).
    "broken_frequent_skips": ("skips", "frequent-skips", "skipped_after_first_update", (1, 1),
                              "broken_frequent_skips.py"),
    # backoff 0.9 and growth_interval=1: all 4 steps after the first update are skipped
    "broken_timid_backoff": ("skips", "frequent-skips", "skipped_after_first_update", (4, 4),
                             "broken_timid_backoff.py"),
    # a GradScaler built inside train_step: the injected overflow backs the scale off to 32768,
    # and the next step's new scaler starts again from 65536 (measured)
    "broken_scaler_per_step": ("skips", "frequent-skips", "measured", (65536, 65536),
                               "broken_scaler_per_step.py"),
    # ... and with targets that overflow at 65536: one scaler backs off once and stays there
    # (healthy_scaler_passed_in_overflowing: 1 skip), a new one per step skips 10 of the 12
    "broken_scaler_per_step_overflowing": ("skips", "frequent-skips", "skipped", (10, 10),
                                           "broken_scaler_per_step.py"),
}

# Warnings: the rung is `warn`, the verdict stays healthy (exit 0).
WARNINGS = {
    "broken_bf16_scaler_on": ("bf16-no-scaler", "half-open-amp", "broken_bf16_scaler_on.py"),
    # not one fp16 update applied: fp16-scaler has nothing to compare (skip, not pass); every
    # skip is the scale settling, before any real update, so it stays a warning
    "broken_scale_never_settles": ("skips", "frequent-skips", "broken_scale_never_settles.py"),
    # the scheduler advances on the 2 skips of the scale settling from 2**20: a constant shift
    # of 2 steps on a 1000-step cosine, no real update's lr moved beyond the fp16 rtol
    "broken_scheduler_calibration_skips": ("skips", "scheduler-steps-on-skip",
                                           "broken_scheduler_calibration_skips.py"),
}


@pytest.mark.parametrize("name", _grouped(HEALTHY))
def test_healthy_recipe_passes_clean(name, diagnosed):
    result = diagnosed(name)
    record = result.record
    errors = [f for f in record["findings"] if f["severity"] == "error"]
    assert errors == [], errors
    assert result.returncode == 0, result.stderr
    assert record["verdict"] == "healthy"
    statuses = {r["id"]: r["status"] for r in record["rungs"]}
    import yaml
    precisions = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()).get(
        "precisions", ["fp32", "bf16", "fp16"])
    fp16 = ("bf16-no-scaler", "fp16-scaler", "skips")
    for rung in ("reproducibility", "fp32-accum", "bf16-no-scaler", "fp16-scaler",
                 "double-scaling", "skips"):
        used = rung not in fp16 or ("bf16" if rung == "bf16-no-scaler" else "fp16") in precisions
        assert statuses[rung] == ("pass" if used else "skip"), (rung, record["rungs"])
    spec = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    clip_space = next(r for r in record["rungs"] if r["id"] == "clip-space")
    if spec.get("max_grad_norm") is not None and "fp16" in precisions:
        assert clip_space["status"] == "pass", clip_space
    elif clip_space["status"] != "pass":   # a loop may clip at its own fixed threshold
        assert clip_space["status"] == "skip"
        assert ("never clips" in clip_space["summary"] or "fp16 is not in the spec's "
                "precisions" in clip_space["summary"]), clip_space
    assert statuses["ddp-sync"] == ("pass" if name.endswith("_ddp") else "skip")
    assert record["device"] == "cpu"
    if "fp16" not in precisions:
        assert "fp16 is not in the spec's precisions" in next(
            r["summary"] for r in record["rungs"] if r["id"] == "fp16-scaler")
        return
    # the fp16 series for the charts
    assert len(record["series"]["scale"]) >= 3
    assert len(record["series"]["skipped"]) >= 3
    # at most one natural overflow (healthy_yolo_ema_checkpoint backs off once at step 1)
    assert sum(record["series"]["skipped"]) <= 1


@pytest.mark.xdist_group("healthy_token_weighted_noloss")
def test_noloss_uneven_micro_batches_take_the_loops_token_weighting(diagnosed):
    """Without `loss`, micro-batches that cannot be concatenated have no full-batch reference:
    the equal-weight mean is only a guess, and a loop that weighs by tokens is right. The
    record and the terminal say which weighting the reference used."""
    run = diagnosed("healthy_token_weighted_noloss")
    record = run.record
    assert record["verdict"] == "healthy"
    assert any("labels of `labels` that are not -100" in n for n in record["notes"]), record
    saved = sorted(run.out.glob("*.json"))[-1]
    shown = run_cli("report", saved).stdout
    assert "note: micro-batches differ in shape and the loop weighs each by its count of" in shown


@pytest.mark.xdist_group("healthy_pretrain_and_finetune")
def test_a_gradscaler_the_loop_never_builds_is_not_an_owner(diagnosed):
    record = diagnosed("healthy_pretrain_and_finetune").record
    rung = next(r for r in record["rungs"] if r["id"] == "double-scaling")
    recipe = RECIPES / "healthy_pretrain_and_finetune.py"
    dormant = rung["details"]["dormant_owners"]
    pretrain_line = next(i for i, text in enumerate(recipe.read_text().splitlines(), 1)
                         if 'GradScaler("cuda")' in text)
    assert [(d["kind"], d["line"]) for d in dormant] == [("GradScaler", pretrain_line)]
    assert "never built by this loop" in rung["summary"]


@pytest.mark.xdist_group("broken_two_scalers_sibling_loops")
def test_double_scaling_counts_and_locates_only_this_loops_owners(diagnosed):
    """A module of three loops, each building a GradScaler: the finding, its message and its
    location are about the two scalers of the diagnosed loop, as the rung's summary is."""
    run = diagnosed("broken_two_scalers_sibling_loops")
    record = run.record
    recipe = RECIPES / "broken_two_scalers_sibling_loops.py"
    lines = recipe.read_text().splitlines()
    built = [i for i, text in enumerate(lines, 1) if "torch.amp.GradScaler(" in text]
    assert len(built) == 4                       # pretrain, train (2), finetune
    [finding] = [f for f in record["findings"] if f["kind"] == "double-scaling"]
    ours = built[1:3]
    assert finding["location"]["line"] == ours[0] == marked_line(recipe, "double-scaling")
    assert finding["evidence"]["measured"] == 2
    assert sorted(o["line"] for o in finding["evidence"]["owners"]) == ours
    assert finding["message"].startswith("2 loss-scale owners on one training path")
    named = {int(n) for n in re.findall(r"broken_two_scalers_sibling_loops\.py:(\d+)",
                                        finding["message"])}
    assert named == set(ours), finding["message"]
    # what the fp16 run saw: the aux scaler's loss in the optimizer the main scaler steps
    assert "held a loss scaled by GradScaler at" in finding["message"]
    rung = _rung(record, "double-scaling")
    assert rung["summary"].startswith("2 loss-scale owners on one training path")
    assert sorted(d["line"] for d in rung["details"]["dormant_owners"]) == [built[0], built[3]]


@pytest.mark.xdist_group("healthy_gan_two_scalers")
def test_double_scaling_one_scaler_per_gan_network_is_healthy(diagnosed):
    """One GradScaler per network, each scaling its own loss and stepping its own optimizer:
    two separate state machines, judged from what the fp16 run saw them do."""
    run = diagnosed("healthy_gan_two_scalers")
    assert run.returncode == 0, run.stderr
    record = run.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    rung = _rung(record, "double-scaling")
    assert rung["status"] == "pass"
    assert "separate state machines, not a double scaling" in rung["summary"]
    scalers = rung["details"]["scaler_ownership"]["scalers"]
    assert sorted((s["optimizers_stepped"], s["optimizers_reached"]) for s in scalers) == [
        ([0], [0]), ([1], [1])]
    assert rung["details"]["scaler_ownership"]["shared"] == []


@pytest.mark.xdist_group("broken_scale_never_settles")
def test_a_rung_that_compared_nothing_does_not_pass(diagnosed):
    run = diagnosed("broken_scale_never_settles")
    record = run.record
    rungs = {r["id"]: r for r in record["rungs"]}
    assert rungs["fp16-scaler"]["status"] == "skip"
    assert rungs["fp16-scaler"]["details"]["steps_compared"] == 0
    assert "applied no update" in rungs["skips"]["summary"]
    # the record is strict JSON even though every grad norm before unscale_ was inf/NaN
    text = next(run.out.glob("*.json")).read_text()
    assert "NaN" not in text and "Infinity" not in text


@pytest.mark.xdist_group("broken_missing_average_clipped")
def test_a_clip_that_saturates_does_not_hide_the_factor(diagnosed):
    """At step 0 both the 4x gradient and the reference exceed max_grad_norm, so after the clip
    they are equal; the norm the loop's clip saw (4x the reference's) gives it away there."""
    record = diagnosed("broken_missing_average_clipped").record
    finding = record["findings"][0]
    assert finding["kind"] == "missing-accumulation-average"
    assert finding["evidence"]["step"] == 0
    assert 3.99 <= finding["evidence"]["measured"] <= 4.01
    assert finding["evidence"]["clip_total_norm"] > 0.5


@pytest.mark.xdist_group("healthy_clip_active")
def test_clip_space_runs_when_clipping_is_configured(diagnosed):
    record = diagnosed("healthy_clip_active").record
    rung = next(r for r in record["rungs"] if r["id"] == "clip-space")
    assert rung["status"] == "pass"
    assert all(abs(r - 1) < 1e-3 for r in rung["details"]["clip_ratios"])
    # one pass serves clip-space and skips: every window but the injected (skipped) one
    steps = yaml.safe_load((CONFIGS / "healthy_clip_active.yaml").read_text())["optimizer_steps"]
    skips = next(r for r in record["rungs"] if r["id"] == "skips")
    assert "window 1" in rung["details"]["shared_with_skips"]
    assert skips["details"]["injected_window"] == 1
    assert skips["details"]["clipping_forced_at"] == pytest.approx(
        rung["details"]["forced_threshold"], rel=1e-5)
    assert rung["details"]["steps_compared"] == steps - 1 >= 2
    assert rung["details"]["clips_that_bit"] >= steps - 1


@pytest.mark.parametrize("name", _grouped(WARNINGS))
def test_warning_recipe(name, diagnosed):
    rung, kind, marker_file = WARNINGS[name]
    result = diagnosed(name)
    record = result.record
    assert result.returncode == 0, result.stderr
    finding = next(f for f in record["findings"] if f["kind"] == kind)
    assert finding["rung"] == rung
    assert finding["severity"] == "warning"
    assert {r["id"]: r["status"] for r in record["rungs"]}[rung] == "warn"
    marker = RECIPES / marker_file
    assert finding["location"]["line"] == marked_line(marker, kind)


@pytest.mark.xdist_group("healthy_clip_with_total_norm")
def test_the_two_step_clip_is_reproduced_and_checked_in_clip_space(diagnosed):
    """get_total_norm + clip_grads_with_norm_ after unscale_, biting every step: the reference
    clips as the loop did, and the clip-space rung runs on it as on clip_grad_norm_."""
    record = diagnosed("healthy_clip_with_total_norm").record
    assert record["verdict"] == "healthy"
    rung = next(r for r in record["rungs"] if r["id"] == "clip-space")
    assert rung["status"] == "pass"
    assert rung["details"]["clip_ratios"]
    assert all(abs(r - 1) < 1e-3 for r in rung["details"]["clip_ratios"])


@pytest.mark.parametrize("name", _grouped(BROKEN))
def test_broken_recipe_is_diagnosed(name, diagnosed):
    rung, kind, key, (low, high), marker_file = BROKEN[name]
    result = diagnosed(name)
    record = result.record
    assert result.returncode == 1, result.stderr
    assert record["verdict"] == "failed"
    assert record["failed_rung"] == rung
    finding = record["findings"][0]
    assert finding["kind"] == kind, record["findings"]
    assert finding["rung"] == rung
    assert finding["severity"] == "error"
    assert low <= finding["evidence"][key] <= high, finding["evidence"]
    assert "expected" in finding["evidence"]
    marker = RECIPES / marker_file
    assert Path(finding["location"]["file"]).resolve() == marker.resolve()
    assert finding["location"]["line"] == marked_line(marker, kind)
    statuses = [r["status"] for r in record["rungs"]]
    failed_at = [r["id"] for r in record["rungs"]].index(rung)
    assert statuses[failed_at] == "fail"
    assert all(s == "not-run" for s in statuses[failed_at + 1:])
    # the record was saved too
    assert list(result.out.glob("*.json"))


def test_loop_error_exits_3_with_record_and_line(records_dir):
    result = run_cli("diagnose", CONFIGS / "broken_loop_error.yaml", "--json", "--out", records_dir)
    assert result.returncode == 3
    record = result.record
    assert record["verdict"] == "error"
    finding = record["findings"][0]
    assert finding["kind"] == "loop-error"
    assert finding["rung"] == "fp32-accum"
    recipe = RECIPES / "broken_loop_error.py"
    assert finding["location"]["line"] == marked_line(recipe, "loop-error")
    assert "RuntimeError" in finding["evidence"]["error"]
    # every finding has evidence.measured and evidence.expected (docs/kinds.md): here the
    # exception, against none
    assert finding["evidence"]["measured"] == finding["evidence"]["error"]
    assert "expected" in finding["evidence"] and finding["evidence"]["expected"] is None
    assert len(list(records_dir.glob("*.json"))) == 1


@pytest.mark.parametrize("build", ["loop_raised", "loop_exited", "rank_raised"])
def test_every_loop_error_carries_measured_and_expected(build):
    # a loop that raised, exited or raised on a rank had no evidence.measured/expected: a
    # reader of findings[].evidence["measured"] hit a KeyError on exactly those
    from ampdoctor.kinds import loop_error as unit
    observed = {"loop_raised": lambda: unit.LoopRaised("fp32-accum", "fp32", "ValueError: x"),
                "loop_exited": lambda: unit.LoopExited("fp32-accum", "fp32", "1"),
                "rank_raised": lambda: unit.RankRaised("ddp-sync", 1, 2, "ValueError: x")}
    finding = getattr(unit, build)(observed[build]())
    assert finding.evidence["measured"] == finding.evidence["error"]
    assert finding.evidence["expected"] is None


def test_loop_ignoring_micro_batches_is_a_loop_error(records_dir):
    """A loop that builds its own data cannot be compared with anything: exit 3, said plainly,
    at the loop's first backward."""
    result = run_cli("diagnose", CONFIGS / "bad" / "own_data.yaml", "--json", "--out",
                     records_dir)
    assert result.returncode == 3
    finding = result.record["findings"][0]
    assert finding["kind"] == "loop-error" and finding["rung"] == "fp32-accum"
    assert "never took a micro-batch from `micro_batches` (0 of 12)" in finding["message"]
    assert finding["evidence"]["backwards"] == 4
    recipe = RECIPES / "bad_own_data.py"
    assert finding["location"]["line"] == marked_line(recipe, "loop-error")


@pytest.mark.xdist_group("healthy_generator_loop")
def test_generator_loop_is_run_and_noted(diagnosed):
    record = diagnosed("healthy_generator_loop").record
    assert record["verdict"] == "healthy"
    assert any("generator" in n for n in record["notes"])
    fp32 = next(r for r in record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["details"]["steps_compared"] == 3


def test_terminal_report_names_kind_line_and_fix(records_dir):
    result = run_cli("diagnose", CONFIGS / "broken_missing_average.yaml", "--out", records_dir)
    assert result.returncode == 1
    line = marked_line(RECIPES / "broken_missing_average.py", "missing-accumulation-average")
    assert "missing-accumulation-average" in result.stdout
    assert f"broken_missing_average.py:{line}" in result.stdout
    assert "fix:" in result.stdout
    assert "measured=4" in result.stdout
    # progress goes to stderr, never stdout
    assert "record saved to" in result.stderr


# --- consequence first: loops written the way popular projects write them -----------------

def _diagnose(name, diagnosed):
    return diagnosed(name).record


def _rung(record, rung_id):
    return next(r for r in record["rungs"] if r["id"] == rung_id)


@pytest.mark.xdist_group("broken_missing_average_clip_bites")
def test_a_clip_that_bites_shows_the_factor_before_the_clip(diagnosed):
    """Both the 4x gradient and (here) the reference exceed max_grad_norm: after the clip they
    agree, so the evidence must carry the pre-clip ratio."""
    finding = _diagnose("broken_missing_average_clip_bites", diagnosed)["findings"][0]
    assert 3.99 <= finding["evidence"]["ratio"] <= 4.01
    assert finding["evidence"]["ratio_after_clip"] < 3.5
    assert finding["evidence"]["clip_total_norm"] > 0.05
    # the headline is the update the step applied (what the chart plots), then the 4x
    record = _diagnose("broken_missing_average_clip_bites", diagnosed)
    after = finding["evidence"]["ratio_after_clip"]
    assert finding["message"].startswith(
        f"Step 0: the update the step applied was {after:.4g}x the reference's after the clip "
        f"(it saw a total norm {finding['evidence']['clip_total_norm']:.4g} > max_norm 0.05)")
    assert "before the clip, the optimizer was handed 4x the reference gradient" in \
        finding["message"]
    run = next(r for r in record["runs"] if r["precision"] == "fp32")
    assert run["update_ratio"][0] == pytest.approx(after, rel=1e-3)


@pytest.mark.xdist_group("broken_token_count_overwritten")
def test_a_divisor_that_varies_per_step_is_not_told_to_divide_by_k(diagnosed):
    finding = _diagnose("broken_token_count_overwritten", diagnosed)["findings"][0]
    ratios = finding["evidence"]["ratios_per_step"]
    assert len(ratios) == 3 and max(ratios) / min(ratios) > 1.5
    assert "varies" in finding["message"]
    assert "accumulation_steps" not in finding["fix"] and "whole optimizer step" in finding["fix"]


@pytest.mark.xdist_group("healthy_clip_scaled_threshold")
def test_clip_in_scaled_space_at_a_scaled_threshold_is_the_same_update(diagnosed):
    record = _diagnose("healthy_clip_scaled_threshold", diagnosed)
    assert record["verdict"] == "healthy" and record["findings"] == []
    rung = _rung(record, "clip-space")
    assert rung["status"] == "pass"
    assert rung["details"]["clips_that_bit"] >= 1
    # the plain run's clip saw S x the true norm: reported, not condemned
    assert all(r > 1000 for r in rung["details"]["clip_ratios"])


@pytest.mark.xdist_group("healthy_timm_fixed_clip_maxnorm")
def test_a_loop_that_clips_at_its_own_threshold_is_judged_at_that_threshold(diagnosed):
    record = _diagnose("healthy_timm_fixed_clip_maxnorm", diagnosed)
    assert record["verdict"] == "healthy" and record["findings"] == []
    rung = _rung(record, "clip-space")
    assert rung["status"] == "pass"
    assert "own threshold" in rung["details"]["forced_clipping"]


@pytest.mark.parametrize("name", _grouped(["healthy_per_group_clip", "healthy_clip_subset"]))
def test_per_group_and_subset_clipping_are_referenced_per_call(name, diagnosed):
    record = _diagnose(name, diagnosed)
    assert record["findings"] == [], (name, record["findings"])
    rung = _rung(record, "clip-space")
    assert rung["status"] == "pass" and rung["details"]["clips_that_bit"] >= 1, rung


@pytest.mark.xdist_group("healthy_fairseq_overflow_retry")
def test_a_window_retried_after_a_skipped_overflow_is_healthy(diagnosed):
    record = _diagnose("healthy_fairseq_overflow_retry", diagnosed)
    assert record["findings"] == []
    skips = _rung(record, "skips")
    assert skips["status"] == "pass"
    assert skips["details"]["steps_on_nonfinite_gradients"] == 0
    assert skips["details"]["backoffs_in_injected_window"] == 1


@pytest.mark.xdist_group("healthy_fairseq_default_scale")
def test_an_init_scale_search_that_outlasts_the_slice_is_rerun_from_where_it_ended(diagnosed):
    """Summed token losses at GradScaler's default 65536 skip all 3 steps of the slice: the
    fp16 runs start again from 8192 (after the 3 halvings), compare real updates and say so."""
    record = _diagnose("healthy_fairseq_default_scale", diagnosed)
    assert record["findings"] == []
    fp16 = _rung(record, "fp16-scaler")
    assert fp16["status"] == "pass" and fp16["details"]["steps_compared"] >= 2
    assert any("init_scale 65536 overflowed all 3 steps" in n and "start from 8192" in n
               for n in record["notes"]), record["notes"]


@pytest.mark.xdist_group("healthy_local_accelerator")
def test_a_project_local_accelerator_is_one_owner(diagnosed):
    record = _diagnose("healthy_local_accelerator", diagnosed)
    assert record["findings"] == []
    rung = _rung(record, "double-scaling")
    assert rung["status"] == "pass"
    assert rung["summary"].startswith("one loss-scale owner"), rung["summary"]


@pytest.mark.parametrize("name", _grouped(["healthy_transformer_dropout",
                                            "healthy_transformer_dropout_off",
                                            "healthy_dropout_mlp"]))
def test_dropout_models_go_through_the_ladder_unchanged(name, diagnosed):
    record = _diagnose(name, diagnosed)
    assert record["verdict"] == "healthy" and record["findings"] == []
    rep = _rung(record, "reproducibility")
    assert rep["status"] == "pass" and rep["details"]["loop_repeat_error"] <= 1e-5


@pytest.mark.xdist_group("healthy_constant_lambdalr_per_microbatch")
def test_a_constant_schedule_stepped_per_micro_batch_is_fine(diagnosed):
    record = _diagnose("healthy_constant_lambdalr_per_microbatch", diagnosed)
    assert record["findings"] == []


@pytest.mark.xdist_group("healthy_yolo_ema_checkpoint")
def test_one_natural_overflow_is_not_frequent_skips(diagnosed):
    record = _diagnose("healthy_yolo_ema_checkpoint", diagnosed)
    assert record["series"]["skipped"] == [False, True, False]
    assert record["findings"] == []
    assert _rung(record, "skips")["status"] == "pass"


@pytest.mark.xdist_group("broken_backward_unscaled_loss")
def test_an_unused_scaled_loss_is_named_not_a_second_unscale(diagnosed):
    """1/S with no second unscale_: the backward ran on the plain loss. The message says so and
    names the unused scaler.scale line; a real double unscale_ keeps its own words."""
    finding = diagnosed("broken_backward_unscaled_loss").record["findings"][0]
    scale_line = marked_line(RECIPES / "broken_backward_unscaled_loss.py", "unscale-twice") - 2
    assert "backward ran on the unscaled loss" in finding["message"]
    assert f"scaler.scale(loss) at line {scale_line}" in finding["message"]
    assert "scaler.scale(loss).backward()" in finding["fix"]
    twice = diagnosed("broken_manual_unscale_twice").record["findings"][0]
    assert "divided by the scale twice" in twice["message"]


@pytest.mark.xdist_group("broken_scheduler_steps_on_skip")
def test_a_scheduler_on_persistent_skips_is_named_with_its_rate_and_the_dropped_updates(diagnosed):
    """The schedule shift and the dropped updates are two consequences of the same skips: both
    errors, the scheduler's first (its line), with the numbers read off the scale trajectory."""
    record = diagnosed("broken_scheduler_steps_on_skip").record
    findings = {f["kind"]: f for f in record["findings"]}
    shift = findings["scheduler-steps-on-skip"]["evidence"]
    assert (shift["steady_skips"], shift["steps_after_settling"], shift["calibration_skips"]) \
        == (3, 7, 0)
    # 8 windows, 3 skipped, the scheduler stepped in all 8
    assert (shift["scheduler_steps"], shift["optimizer_steps"]) == (8, 5)
    assert shift["own_precision_scaled"] is True
    assert "a steady skip rate of 43%" in findings["scheduler-steps-on-skip"]["message"]
    assert findings["frequent-skips"]["severity"] == "error"


@pytest.mark.xdist_group("broken_scheduler_calibration_skips")
def test_calibration_skips_are_counted_not_failed(diagnosed):
    record = diagnosed("broken_scheduler_calibration_skips").record
    finding = next(f for f in record["findings"] if f["kind"] == "scheduler-steps-on-skip")
    # 2**20 -> 2**19 -> 2**18: two halvings before the first real update, none after it
    assert (finding["evidence"]["calibration_skips"], finding["evidence"]["steady_skips"]) \
        == (2, 0)
    assert finding["evidence"]["lr_shift"] < finding["evidence"]["tolerance"]
    assert "advanced on the 2 skip(s) of the scale's calibration" in finding["message"]
    assert record["verdict"] == "healthy"


@pytest.mark.xdist_group("healthy_amp_recipe_scheduler")
def test_the_textbook_scheduler_steps_on_the_injected_skip_and_passes(diagnosed):
    """The PyTorch AMP order with a warmup: the scheduler advances on ampdoctor's injected
    skip, which by itself shifts nothing in the user's training (the plain fp16 run skips
    nothing); the rung passes and says so."""
    record = diagnosed("healthy_amp_recipe_scheduler").record
    skips = next(r for r in record["rungs"] if r["id"] == "skips")
    assert skips["status"] == "pass"
    assert skips["details"]["scheduler_stepped_on_injected_skip"] is True
    assert "the scheduler advanced on the injected skip too" in skips["summary"]


@pytest.mark.parametrize("name, reached, restarted", [
    pytest.param("broken_scaler_per_step", 32768, 65536,
                 marks=pytest.mark.xdist_group("broken_scaler_per_step")),
    pytest.param("broken_scaler_per_step_overflowing", 32768, 65536,
                 marks=pytest.mark.xdist_group("broken_scaler_per_step_overflowing")),
])
def test_a_scaler_rebuilt_every_step_is_named_at_its_construction(name, reached, restarted,
                                                                   diagnosed):
    """One persistent GradScaler carries its backoff into the next step; a new one per step
    starts again from its initial scale: the scale trajectory says it, the finding names the
    GradScaler(...) line inside the step and says to build it once, outside the loop."""
    record = diagnosed(name).record
    finding = record["findings"][0]
    evidence = finding["evidence"]
    assert (evidence["expected"], evidence["measured"]) == (reached, restarted)
    assert evidence["scale_resets"] >= 1
    assert evidence["scalers_built"] == evidence["steps"] == yaml.safe_load(
        (CONFIGS / f"{name}.yaml").read_text())["optimizer_steps"]
    assert finding["location"]["function"] == "train_step"
    assert "GradScaler once, before the training loop" in finding["fix"]
    assert "Start from GradScaler's defaults" not in finding["fix"]
    assert f"backed off to {reached}" in finding["message"]
    # the frequent-skips of the scale settling is not said a second time
    assert [f["kind"] for f in record["findings"]].count("frequent-skips") == 1
