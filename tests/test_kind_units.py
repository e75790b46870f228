"""Each kind's unit from a hand-built observation: the severity on both sides of its boundary
and the words and numbers of its message, computed here (a ratio from two norms written in the
test, a rate from two counts), not by ampdoctor. The end-to-end recipes check the same kinds
from real runs (tests/test_e2e_diagnose.py, tests/test_frameworks.py, tests/test_script_mode.py).
"""

from __future__ import annotations

import pytest

from ampdoctor.core.enums import KindId, RungId, Severity
from ampdoctor.core.findings import Location
from ampdoctor.kinds import CATALOGUE
from ampdoctor.kinds.baseline import NotRepeatable, Runs, not_repeatable

LINE = Location("train.py", 12, "train_loop", "x = x + torch.randn_like(x)")


# --- nondeterministic-baseline --------------------------------------------------------------

def test_two_loop_runs_that_differ_are_an_error_naming_the_draw():
    # two runs' norms 1.0 and 1.0125: relative difference 0.0125
    rel = abs(1.0125 - 1.0) / 1.0
    finding = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.LOOP, rel_err=rel,
                                           cosine=0.99991234, tolerance=1e-5,
                                           random_modules=(), random_site=LINE,
                                           location=LINE))
    assert (finding.kind, finding.severity) == (KindId.NONDETERMINISTIC_BASELINE,
                                                Severity.ERROR)
    assert finding.message.startswith(
        "Two fp32 runs of the loop from the same weights differ by 0.0125 (relative) under a "
        "different RNG state (cosine 0.99991).")
    assert "(first at train.py:12)" in finding.message
    assert finding.evidence == {"measured": 0.0125, "expected": 0.0, "tolerance": 1e-5,
                                "cosine": 0.999912, "random_modules": []}
    assert finding.location == LINE
    assert finding.title == CATALOGUE[KindId.NONDETERMINISTIC_BASELINE].title


@pytest.mark.parametrize("aligned, says", [
    (False, "Random layers active in the model: Dropout(p=0.1)."),
    (True, "their forwards were aligned per micro-batch, so the randomness comes from "
           "elsewhere")])
def test_random_layers_are_named_aligned_or_not(aligned, says):
    finding = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.REFERENCE,
                                           rel_err=3e-3, cosine=0.5, tolerance=1e-5,
                                           random_modules=("Dropout(p=0.1)",),
                                           aligned=aligned))
    assert says in finding.message
    assert finding.message.startswith("Two fp32 reference gradients at the same weights "
                                      "differ by 0.003 (relative)")


def test_a_script_reading_different_data_is_a_warning_with_nothing_measured():
    """The boundary: nothing was compared, so nothing fails."""
    finding = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.SCRIPT_DATA,
                                           location=LINE))
    assert finding.severity is Severity.WARNING
    assert finding.evidence == {"measured": "different data", "expected": "the same data"}
    assert "without a fixed seed" in finding.message


def test_script_runs_and_script_reference_are_errors_with_their_difference():
    rel = (2.5 - 2.0) / 2.0      # 0.25
    runs = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.SCRIPT, rel_err=rel,
                                        tolerance=1e-5, random_site=LINE, location=LINE))
    assert runs.severity is Severity.ERROR
    assert "(relative difference 0.25)" in runs.message
    assert "(it draws random numbers at train.py:12)" in runs.message
    assert runs.evidence == {"measured": 0.25, "expected": 0.0, "tolerance": 1e-5}
    ref = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.SCRIPT_REFERENCE,
                                       rel_err=rel))
    assert ref.message == ("Two runs of the reference (--reference-args) at the same weights "
                           "differ by 0.25 (relative): the fp32 reference is not repeatable.")
    assert ref.evidence == {"measured": 0.25, "expected": 0.0}


# --- frequent-skips -------------------------------------------------------------------------

def _trajectory(flags, first_ok, own_scaler=True, scales=None, growth_interval=2000,
                grew=False):
    from ampdoctor.kinds.frequent_skips import SkipTrajectory
    scales = scales if scales is not None else tuple(1024.0 for f in flags if not f)
    return SkipTrajectory(RungId.SKIPS, tuple(flags), tuple(scales), first_ok, 0,
                          growth_interval, 2.0, grew, own_scaler=own_scaler, location=LINE)


@pytest.mark.parametrize("after, severity", [
    # 3 skips in the 9 steps after the first real update: 33 % > 25 %; in 12 steps: 25 %, not >
    ([True, False, False] * 3, Severity.ERROR), ([True, False, False, False] * 3, None)])
def test_skips_after_the_first_real_update_fail_above_the_threshold(after, severity):
    from ampdoctor.kinds.frequent_skips import skip_trajectory
    flags = [False] + after                       # step 0 is the first real update
    finding = skip_trajectory(_trajectory(flags, first_ok=0))
    if severity is None:
        assert finding is None
        return
    assert finding is not None and finding.severity is severity
    skipped, steps_after = 3, len(after)
    assert (f"After its first real update (step 0) the fp16 run skipped {skipped} of the "
            f"{steps_after} steps that followed ({skipped / steps_after:.0%}, threshold 25%)"
            ) in finding.message
    assert finding.evidence["skip_rate_after_first_update"] == round(skipped / steps_after, 6)
    assert finding.evidence["measured"] == round(skipped / len(flags), 6)


def test_the_same_skips_in_a_run_forced_into_fp16_are_a_warning():
    from ampdoctor.kinds.base import FORCED_FP16
    from ampdoctor.kinds.frequent_skips import skip_trajectory
    finding = skip_trajectory(_trajectory([False] + [True, False, False] * 3, first_ok=0,
                                          own_scaler=False))
    assert finding is not None and finding.severity is Severity.WARNING
    assert finding.message.endswith(FORCED_FP16)


def test_a_run_that_never_settles_is_a_warning_with_its_count():
    from ampdoctor.kinds.frequent_skips import skip_trajectory
    finding = skip_trajectory(_trajectory([True] * 4, first_ok=4, scales=(0.5, 0.25)))
    assert finding is not None and finding.severity is Severity.WARNING
    assert finding.message.startswith(
        "The fp16 run skipped 4 of 4 optimizer steps (100%, threshold 25%) and the scale fell "
        "to 0.25")


def test_a_scaler_rebuilt_every_step_is_an_error_with_both_scales():
    from ampdoctor.kinds.frequent_skips import RESET_FIX, ScaleReset, scale_reset
    finding = scale_reset(ScaleReset(RungId.SKIPS, "plain fp16 run", 2, 3,
                                     (True, True, True), (32768.0, 32768.0, 32768.0),
                                     reached=32768.0, restarted=65536.0, growth_interval=2000,
                                     location=LINE))
    assert finding.severity is Severity.ERROR and finding.fix == RESET_FIX
    assert "the GradScaler(...) call at train.py:12 runs again" in finding.message
    assert "The scale backed off to 32768, yet the next step started again from 65536" \
        in finding.message
    assert finding.message.endswith("3 of 3 steps were skipped.")
    assert finding.evidence["measured"] == 65536.0 and finding.evidence["expected"] == 32768.0


@pytest.mark.parametrize("skipped, steps, fails", [(2, 7, True), (2, 8, False), (1, 2, False)])
def test_the_sentinels_steady_skips_boundary(skipped, steps, fails):
    """2/7 = 28.6 % > 25 %; 2/8 = 25 % is not above; 1 skip is below MIN_COUNTED_SKIPS."""
    from ampdoctor.kinds.frequent_skips import SteadySkips, steady_skips
    finding = steady_skips(SteadySkips("watch", skipped, steps, 1024.0, 2.0, 2000, 0.5))
    assert (finding is not None) is fails
    if finding is not None:
        assert f"a rate of {skipped / steps:.0%}" in finding.message
        assert finding.evidence["measured"] == round(skipped / steps, 6)


# --- no-zero-grad-after-skip ----------------------------------------------------------------

@pytest.mark.parametrize("in_a_row, own_scaler, severity", [
    (0, True, None), (1, True, Severity.ERROR), (2, False, Severity.WARNING)])
def test_windows_poisoned_after_the_injected_overflow(in_a_row, own_scaler, severity):
    from ampdoctor.kinds.skips import SkippedAfterInjection, skipped_after_injection
    applied = (0, 1, 4)
    finding = skipped_after_injection(SkippedAfterInjection(
        RungId.SKIPS, 2, in_a_row, applied, (False, False, True, True, False),
        own_scaler=own_scaler, location=LINE))
    if severity is None:
        assert finding is None
        return
    assert (finding.kind, finding.severity) == (KindId.NO_ZERO_GRAD_AFTER_SKIP, severity)
    assert finding.message.startswith(f"After the injected overflow in window 2 the next "
                                      f"{in_a_row} window(s) were skipped too")
    assert finding.evidence["measured"] == in_a_row
    assert finding.evidence["applied_windows"] == [0, 1, 4]


def test_a_skip_path_that_keeps_the_inf_names_the_parameter_and_torchs_refusal():
    from ampdoctor.kinds.skips import SkipPathLeftOpen, skip_path_left_open
    error = "RuntimeError: unscale_() has already been called on this optimizer"
    finding = skip_path_left_open(SkipPathLeftOpen(RungId.SKIPS, "fc.weight", error,
                                                   location=LINE))
    assert finding.severity is Severity.ERROR
    assert finding.message.startswith("An inf injected into fc.weight.grad sent the loop down")
    assert f"({error})" in finding.message
    assert finding.evidence["error"] == error


# --- update-per-microbatch ------------------------------------------------------------------

@pytest.mark.parametrize("before, after, backoffs", [(65536.0, 32768.0, 1),
                                                     (65536.0, 16384.0, 2)])
def test_backoffs_in_the_injected_window(before, after, backoffs):
    import math

    from ampdoctor.kinds.scaling import Backoffs, backoffs_in_window
    assert round(math.log(after / before) / math.log(0.5)) == backoffs   # the oracle
    finding = backoffs_in_window(Backoffs(RungId.SKIPS, backoffs, before, after, 0.5,
                                          location=LINE))
    if backoffs == 1:
        assert finding is None
        return
    assert (finding.kind, finding.severity) == (KindId.UPDATE_PER_MICROBATCH, Severity.ERROR)
    assert finding.message.startswith("One overflowing micro-batch backed the scale off 2 "
                                      "times (65536 -> 16384, backoff factor 0.5)")


def test_a_refused_update_counts_the_updates_before_the_step():
    from ampdoctor.kinds.scaling import RefusedUpdate, refused_update_finding
    finding = refused_update_finding(RefusedUpdate(RungId.FP16_SCALER, 3, "AssertionError: x",
                                                   microbatch=1, location=LINE))
    assert finding.severity is Severity.ERROR
    assert finding.evidence == {"measured": 3, "expected": 0,
                                "updates_before_the_windows_step": 3,
                                "error": "AssertionError: x", "microbatch": 1}


# --- the step state machine's kinds (rules/scale_state.py observations) ---------------------

def test_a_clip_in_scaled_space_measures_the_scale_and_is_a_warning_while_updates_match():
    from ampdoctor.kinds.clipping import ScaledClip, scaled_clip
    seen, true = 57427.0, 0.876382          # the clip saw S x the true norm
    o = ScaledClip(RungId.FP16_SCALER, 0, 65536.0, seen, true, 1.0, location=LINE)
    error = scaled_clip(o)
    assert (error.kind, error.severity) == (KindId.CLIP_BEFORE_UNSCALE, Severity.ERROR)
    assert error.evidence["measured"] == float(f"{seen / true:.6g}")      # 65527.3
    assert (f"it saw a gradient norm of 57427 where the true norm is 0.876382 — a ratio of "
            f"{seen / true:.6g}, the loss scale (65536)") in error.message
    from dataclasses import replace
    warning = scaled_clip(replace(o, update_matched=True))
    assert warning.severity is Severity.WARNING
    assert warning.message.startswith("Every fp16 update matched the reference, but it clipped "
                                      "gradients still multiplied by the loss scale")
    assert warning.message.endswith(f"({error.message})")


def test_a_clip_of_one_of_two_optimizers_names_the_one_not_unscaled():
    from ampdoctor.kinds.clipping import ScaledClip, scaled_clip
    finding = scaled_clip(ScaledClip(RungId.FP16_SCALER, 1, 1024.0, None, None, 1.0,
                                     optimizer=1, optimizers=2, unscaled_others=(0,)))
    assert finding.evidence["optimizer"] == 1
    assert finding.message.endswith(
        " Optimizer 1 (of 2) had not been unscaled although optimizer(s) [0] had: the clip "
        "mixed scaled and true gradients; call scaler.unscale_() on optimizer 1 before "
        "clipping.")


def test_a_clip_by_value_in_scaled_space_is_off_by_the_scale():
    from ampdoctor.kinds.clipping import ScaledClip, scaled_clip
    finding = scaled_clip(ScaledClip(RungId.FP16_SCALER, 0, 256.0, None, None, 0.5,
                                     by_value=True))
    assert finding.evidence["measured"] == 256.0
    assert "a clip value 256x too small in true-gradient space" in finding.message


@pytest.mark.parametrize("matched, severity", [(False, Severity.ERROR),
                                               (True, Severity.WARNING)])
def test_a_direct_step_on_scaled_gradients(matched, severity):
    from ampdoctor.kinds.scaling import StepOnScaled, step_on_scaled
    ratio = 65536.0 * 1.0000004               # the update S x the reference
    finding = step_on_scaled(StepOnScaled(RungId.FP16_SCALER, 2, 65536.0, 1, ratio,
                                          update_matched=matched))
    assert (finding.kind, finding.severity) == (KindId.MISSING_UNSCALE, severity)
    assert f"its gradient is {ratio:.6g}x the reference." in finding.message
    assert finding.evidence["measured"] == float(f"{ratio:.6g}")


def test_updates_without_a_step_and_a_loss_scaled_twice_are_errors():
    from ampdoctor.kinds.double_scaling import ScaledTwice, scaled_twice
    from ampdoctor.kinds.scaling import UpdateWithoutStep, update_without_step
    update = update_without_step(UpdateWithoutStep(RungId.FP16_SCALER, 0, 1024.0, 12, 3))
    assert update.severity is Severity.ERROR
    assert update.message == ("scaler.update() ran 12 times for 3 scaler.step() calls: more "
                              "than once per optimizer step.")
    twice = scaled_twice(ScaledTwice(RungId.FP16_SCALER, 0, 1024.0, 1024.0, 0))
    assert twice.evidence["measured"] == float(f"{1024.0 * 1024.0:.6g}")   # 1048580.0
    assert "the effective loss scale is 1.04858e+06, not 1024." in twice.message


# --- rung context: the clip-space rung's forced threshold -----------------------------------

def test_a_forced_clip_leads_every_kind_but_the_one_that_words_its_clip():
    from ampdoctor.kinds import decide
    from ampdoctor.kinds.base import Observed
    seen = Observed(RungId.CLIP_SPACE, Severity.ERROR, "Step 0: off.", forced_clip=0.0123456)
    lead = ("With clipping forced (max_grad_norm=0.01235, a tenth of the true gradient norm) "
            "the clipped update differs from the reference clipped the way the loop meant: ")
    assert decide(KindId.GRADIENT_MISMATCH, seen).message == lead + "Step 0: off."
    assert decide(KindId.CLIP_BEFORE_UNSCALE, seen).message == "Step 0: off."


# --- loop-error -----------------------------------------------------------------------------

def test_a_loop_that_raised_in_a_helper_names_the_loops_line():
    from ampdoctor.kinds.loop_error import LoopRaised, loop_raised
    loop = Location("/src/train.py", 30, "train_loop")
    helper = Location("/src/helpers.py", 8, "clip")
    finding = loop_raised(LoopRaised(RungId.FP32_ACCUM, "fp32", "TypeError: x",
                                     frames=(loop, helper), clip_given_none="clip_grad_norm_",
                                     location=helper))
    assert finding.severity is Severity.ERROR
    assert finding.message.startswith("The loop raised in the fp32 run: TypeError: x. torch's "
                                      "clip_grad_norm_() was given None as its threshold")
    assert finding.message.endswith(" (in clip(), called from the loop at train.py:30)")
    assert finding.evidence["loop_line"] == "/src/train.py:30"
    assert finding.evidence["user_frames"] == ["/src/train.py:30 in train_loop",
                                               "/src/helpers.py:8 in clip"]


def test_ranks_that_hung_name_where_they_waited():
    from ampdoctor.kinds.loop_error import RanksHung, ranks_hung
    finding = ranks_hung(RanksHung(RungId.DDP_SYNC, 2, 30.0, (1,), (0,), (0, 1),
                                   location=LINE))
    assert finding.message == (
        "Rank(s) 1 of 2 did not finish the loop within ddp.timeout_s = 30 s and were stopped, "
        "waiting at train.py:12 (train_loop): a hang (a collective its peers never join -- "
        "ranks taking different numbers of steps or syncs --, or a loop that never ends); "
        "rank(s) 0 had left the loop and waited for the others.")
    assert finding.evidence["measured"] == 1


# --- half-open-amp --------------------------------------------------------------------------

@pytest.mark.parametrize("step, severity", [(None, Severity.WARNING), (1, Severity.ERROR)])
def test_autocast_in_the_fp32_run_fails_once_an_update_differs(step, severity):
    from ampdoctor.kinds.precision import AutocastInFp32, autocast_in_fp32
    rel = abs(1.0021 - 1.0) / 1.0          # 0.0021 off the reference
    finding = autocast_in_fp32(AutocastInFp32(RungId.FP32_ACCUM, "bfloat16", 3, step, rel,
                                              1.0021, 0.9999871, 1e-5, location=LINE))
    assert (finding.kind, finding.severity) == (KindId.HALF_OPEN_AMP, severity)
    assert finding.evidence["measured"] == "bfloat16" and finding.evidence["autocast_entered"] == 3
    if step is not None:
        assert (f"Step 1 differs from the fp32 reference by {rel:.3g} (relative; tolerance "
                "1e-05, norm ratio 1.002, cosine 0.99999): rounding, not a factor.") \
            in finding.message
        assert finding.evidence["relative_error"] == round(rel, 6)


def test_a_scaler_in_bf16_is_a_warning_and_says_where():
    from ampdoctor.kinds.precision import ScalerInBf16, scaler_in_bf16
    run = scaler_in_bf16(ScalerInBf16(RungId.BF16_NO_SCALER, 65536.0, location=LINE))
    script = scaler_in_bf16(ScalerInBf16(RungId.BF16_NO_SCALER, 65536.0, in_script=True))
    assert run.severity is script.severity is Severity.WARNING
    assert run.message.startswith("A GradScaler is enabled in the bf16 run.")
    assert script.message.startswith("A GradScaler is enabled in the script, whose autocast "
                                     "asks for bfloat16 only.")


def test_weights_cast_to_fp16_name_the_first_tensors_and_the_count():
    from ampdoctor.kinds.precision import WeightsCast, weights_cast
    names = tuple(f"layer{i}.weight" for i in range(5))
    finding = weights_cast(WeightsCast(RungId.FP32_ACCUM, "fp32", ("torch.float16",), names, 6,
                                       loop_is_reference=True,
                                       location=Location("train.py", 9, "f", "model.half()")))
    assert finding.severity is Severity.ERROR
    assert ("The fp32 run cast the model's weights to float16 (`model.half()`, line 9): 5 of 6 "
            "trainable parameter tensor(s) (`layer0.weight`, `layer1.weight`, `layer2.weight` "
            "and 2 more)") in finding.message
    assert "the loop-as-reference, the same loop, is cast too" in finding.message
    assert finding.evidence["parameters_cast"] == 5


@pytest.mark.parametrize("entered, says", [(0, "autocast was never entered"),
                                           (2, "autocast was entered 2 time(s) but never "
                                               "enabled")])
def test_autocast_off_is_an_error(entered, says):
    from ampdoctor.kinds.precision import AutocastOff, autocast_off
    finding = autocast_off(AutocastOff(RungId.BF16_NO_SCALER, "bf16", "bfloat16", "cpu",
                                       entered, scaler=False))
    assert finding.severity is Severity.ERROR
    assert finding.message == (f"The bf16 run asked for autocast(bfloat16) but {says} on cpu: "
                               "every forward ran in fp32, so this 'mixed precision' run is "
                               "really fp32.")


# --- missing-unscale / unscale-twice / double-scaling from torch's refusals and the run ----

def test_torchs_refusal_of_a_second_unscale_names_the_first_call():
    from ampdoctor.kinds.scaling import UnscaleRefused, unscale_refused
    first = Location("train.py", 20, "train_loop")
    finding = unscale_refused(UnscaleRefused(RungId.FP16_SCALER, "fp16", "RuntimeError: x",
                                             first=first, location=LINE))
    assert finding.message.endswith("The first call was at train.py:20; keep one of the two.")
    assert finding.evidence["first_unscale"] == "train.py:20"
    same = unscale_refused(UnscaleRefused(RungId.FP16_SCALER, "fp16", "RuntimeError: x",
                                          first=first, first_is_refused=True))
    assert same.message.endswith("divided by the scale twice.")


def test_a_second_scale_on_the_loss_reports_the_extra_factor():
    from ampdoctor.kinds.double_scaling import SecondScale, second_scale
    v32, scale, extra = 0.5, 1024.0, 128.0
    v16 = v32 * scale * extra               # the loss reaching backward
    finding = second_scale(SecondScale(RungId.FP16_SCALER, v32, v16, scale, extra, 3, 4))
    assert finding.severity is Severity.ERROR
    assert finding.message.startswith(
        "The loss reaching backward is 128x what the scaler alone would give (fp32 loss 0.5 x "
        "scale 1024 = 512, got 65536)")
    assert finding.evidence["measured"] == extra * scale and finding.evidence["expected"] == scale


# --- step-per-microbatch / zero-grad-inside-accumulation / missing-zero-grad ----------------

def test_more_steps_than_windows_is_an_error_with_the_steps_per_window():
    from ampdoctor.kinds.stepping import StepsPerWindow, steps_per_window
    steps, windows = 12, 3                  # K = 4: a step on every micro-batch
    finding = steps_per_window(StepsPerWindow(RungId.FP32_ACCUM, "fp32", 0, steps, windows, 4,
                                              1, framework="Fabric", location=LINE))
    assert (finding.kind, finding.severity) == (KindId.STEP_PER_MICROBATCH, Severity.ERROR)
    assert finding.message.startswith(
        f"The optimizer stepped 12 times for 3 windows of K=4 micro-batches in the fp32 run "
        f"({steps / windows:.3g} steps per window; the first step came after 1 "
        "micro-batch(es)).")
    assert finding.evidence["steps_per_window"] == steps / windows
    from ampdoctor.kinds import FRAMEWORK_FIXES
    assert finding.fix == FRAMEWORK_FIXES[(KindId.STEP_PER_MICROBATCH, "Fabric")]


def test_an_off_by_one_window_names_the_first_count():
    from ampdoctor.kinds.mismatch import OFF_BY_ONE_TITLE, OffBoundary, off_boundary
    finding = off_boundary(OffBoundary(RungId.FP32_ACCUM, 0, 4, (1, 5, 9)))
    assert finding.title == OFF_BY_ONE_TITLE
    assert finding.message.startswith("The optimizer stepped after 1 micro-batch(es), not on a "
                                      "boundary of K=4")
    assert finding.evidence["microbatches_at_each_step"] == [1, 5, 9]


@pytest.mark.parametrize("measured, severity", [(True, Severity.ERROR),
                                                (False, Severity.WARNING)])
def test_a_zero_grad_inside_the_window_fails_only_when_the_update_was_compared(measured,
                                                                              severity):
    from ampdoctor.kinds.stepping import ZeroedInside, zeroed_inside
    ratio = 1 / 4 * 1.003                    # one of four micro-batches reached the step
    comparison = {"measured": ratio, "expected": 1.0, "step": 1} if measured else None
    finding = zeroed_inside(ZeroedInside(RungId.FP32_ACCUM, 1, 4, 1 if measured else None,
                                         ratio if measured else None,
                                         0.99 if measured else None, comparison=comparison))
    assert finding.severity is severity
    assert finding.evidence["measured"] == 1 and finding.evidence["expected"] == 4
    if measured:
        assert list(finding.evidence)[:3] == ["measured", "expected", "step"]
        assert finding.evidence["norm_ratio"] == round(ratio, 6)
        assert f"gradient norm ratio {ratio:.4g} to the reference" in finding.message


def test_gradients_carried_over_name_the_parameters_not_cleared():
    from ampdoctor.kinds.stepping import CarriedOver, carried_over
    names = tuple(f"p{i}" for i in range(6))
    finding = carried_over(CarriedOver(RungId.FP32_ACCUM, 2, names, 8, 2.0, {"step": 2}))
    assert (finding.kind, finding.severity) == (KindId.MISSING_ZERO_GRAD, Severity.ERROR)
    assert finding.message.startswith("Step 2: for 6 of 8 parameters (p0, p1, p2, p3, ...) the "
                                      "optimizer consumed this window's reference gradient plus "
                                      "what step 1 already applied")
    assert "(the zero_grad call covers only part of the model)" in finding.message


def test_the_sentinels_counts_are_errors():
    from ampdoctor.kinds.stepping import (
        OneBackwardPerStep,
        ZeroedInWindow,
        one_backward_per_step,
        zeroed_in_window,
    )
    one = one_backward_per_step(OneBackwardPerStep("watch", 4, 3, (1, 1, 1)))
    assert one.severity is Severity.ERROR and "4x as many updates each on 1/4" in one.message
    zeroed = zeroed_in_window(ZeroedInWindow("watch", 5, 4, 4, 3))
    assert zeroed.evidence["measured"] == 4 - 3
    assert "the gradient of only the last 1 micro-batch(es)" in zeroed.message


# --- scheduler-per-microbatch ---------------------------------------------------------------

def test_a_schedule_stepped_per_micro_batch_is_an_error_with_its_speed():
    from ampdoctor.kinds.schedule import ScheduleTooFast, schedule_too_fast
    finding = schedule_too_fast(ScheduleTooFast(RungId.FP32_ACCUM, "fp32", "LambdaLR", 12, 3, 4,
                                                1, 0.5, 0.2))
    assert finding.severity is Severity.ERROR
    assert finding.evidence["measured"] == 12 / 3
    assert ("optimizer step 1 used lr 0.5 where the schedule gives 0.2 for that step; the "
            "schedule runs 4x too fast.") in finding.message


# --- gradient-mismatch ----------------------------------------------------------------------

@pytest.mark.parametrize("cosine, hint", [(0.99999, True), (0.5, False)])
def test_no_known_shape_says_whether_the_direction_holds(cosine, hint):
    from ampdoctor.core import thresholds
    from ampdoctor.kinds.mismatch import Unexplained, unexplained
    finding = unexplained(Unexplained(RungId.FP32_ACCUM, 1, 1, "fp32", 0.37, 1.37, cosine, 1e-5,
                                      {"step": 1}))
    assert (cosine > thresholds.SAME_DIRECTION_COSINE) is hint
    assert ("only the size differs" in finding.message) is hint
    assert "matching no known mistake" in finding.message


def test_a_clip_after_its_step_reports_the_unclipped_factor():
    from ampdoctor.kinds.mismatch import CLIP_AFTER_STEP_FIX, ClipAfterStep, clip_after_step
    finding = clip_after_step(ClipAfterStep(RungId.FP32_ACCUM, 0, 5.0, 1.0, 1e-5, ratio=1.0))
    assert finding.fix == CLIP_AFTER_STEP_FIX
    assert finding.evidence["measured"] == 5.0 and finding.evidence["ratio"] == 1.0
    assert "so the update used a gradient 5x the clipped one" in finding.message


@pytest.mark.parametrize("steps, says", [(0, "No optimizer step was taken in 8 micro-batches"),
                                         (2, "The fp32 loop took 2 optimizer step(s) for the 3 "
                                             "windows")])
def test_too_few_steps(steps, says):
    from ampdoctor.kinds.mismatch import TooFewSteps, too_few_steps
    finding = too_few_steps(TooFewSteps(RungId.FP32_ACCUM, steps, 3, 4, 8, 12, backwards=8))
    assert finding.severity is Severity.ERROR and finding.message.startswith(says)
    assert finding.evidence["measured"] == steps


def test_a_call_order_no_reference_measured_is_a_warning_that_says_so():
    """Script mode without --reference-args: the state machine's finding cannot be weighed
    against an update, so it is a warning whatever it would be with a reference."""
    from ampdoctor.kinds.base import UNMEASURED
    from ampdoctor.kinds.scaling import SecondUnscale, second_unscale
    finding = second_unscale(SecondUnscale(RungId.FP16_SCALER, 0, 1024.0, unmeasured=True))
    assert finding.severity is Severity.WARNING
    assert finding.message == ("unscale_() called twice on the same optimizer in one step"
                               + UNMEASURED)
    assert UNMEASURED == (" (No reference was run, so whether the update differs was not "
                          "measured.)")


@pytest.mark.parametrize("norm, severity", [(4096.0, Severity.ERROR), (0.5, Severity.WARNING)])
def test_a_scripts_scaled_clip_fails_once_it_shrinks_the_update(norm, severity):
    """Scale 1024, threshold 1: a scaled norm of 4096 (true 4) is clipped by 1/4096 where true
    space clips by 1/4 (a shrink of 1/1024); a scaled norm of 0.5 is not clipped either way."""
    from ampdoctor.core import thresholds
    from ampdoctor.kinds.clipping import ScriptScaledClip, script_scaled_clip
    seen, meant = min(1.0, 1.0 / norm), min(1.0, 1.0 / (norm / 1024.0))
    assert (seen / meant < thresholds.CLIP_BITES_BELOW) is (severity is Severity.ERROR)
    finding = script_scaled_clip(ScriptScaledClip(RungId.CLIP_SPACE, norm, 1024.0, 1.0))
    assert finding.severity is severity
    assert finding.evidence["clip_coefficient"] == float(f"{seen:.6g}")
    assert f"It multiplied the gradient by {seen:.4g} where the threshold 1 in true space " \
        f"gives {meant:.4g}" in finding.message


def test_a_rate_set_per_micro_batch_is_an_error_with_the_rates_it_measured():
    from ampdoctor.kinds.schedule import RateSetPerMicroBatch, rate_set_per_micro_batch

    K = 4
    warmup = [1e-3 * (i + 1) / 9 for i in range(K)]          # get_lr(0..3) of a 9-step warm-up
    finding = rate_set_per_micro_batch(RateSetPerMicroBatch(
        RungId.FP32_ACCUM, "fp32", K, 0, K, tuple(warmup), 0, warmup[-1], warmup[0],
        location=Location("train.py", 34)))
    assert (finding.kind, finding.severity) == (KindId.SCHEDULER_PER_MICROBATCH, Severity.ERROR)
    assert finding.evidence["lr_used"] == warmup[-1]
    assert finding.evidence["lr_expected"] == warmup[0]
    assert (finding.evidence["measured"], finding.evidence["expected"]) == (K, 1)
    assert f"used lr {warmup[-1]:.6g}" in finding.message
    assert f"uses {warmup[0]:.6g}" in finding.message and "4x too fast" in finding.message
    assert "optimizer-step counter" in finding.fix and finding.location.line == 34


def test_a_norm_read_at_an_infinite_threshold_is_a_warning_and_explains_no_mismatch():
    """`clip_grad_norm_(params, inf)` before `unscale_` (a grad norm computed for logging)
    clips nothing: a warning about the logged value, never the cause of a mismatch."""
    from dataclasses import replace

    from ampdoctor.core.findings import Finding
    from ampdoctor.kinds.clipping import ScaledClip, scaled_clip
    from ampdoctor.rules.scale_state import explain_with_calls

    seen, true = 190589.0, 2.90818
    o = ScaledClip(RungId.FP16_SCALER, 0, 65536.0, seen, true, float("inf"), location=LINE)
    for update_matched in (False, True):
        finding = scaled_clip(replace(o, update_matched=update_matched))
        assert finding.severity is Severity.WARNING
        assert "never clips, so the update is not affected" in finding.message
        assert f"{seen / true:.6g}x, the loss scale (65536)" in finding.message
        assert "scaler.get_scale()" in finding.fix
    mismatch = Finding(RungId.FP16_SCALER, KindId.GRADIENT_MISMATCH, Severity.ERROR, "off")
    judgement = type("J", (), {"steps": []})()
    kept, warnings = explain_with_calls([mismatch], [o], judgement)
    assert (kept, warnings) == ([mismatch], [])
    finite = replace(o, max_norm=1.0)
    kept, _ = explain_with_calls([mismatch], [finite], judgement)
    assert [f.kind for f in kept] == [KindId.CLIP_BEFORE_UNSCALE]


def test_a_skip_path_without_update_is_a_loop_error_whose_fix_says_update_on_every_path():
    from ampdoctor.kinds.loop_error import UpdateMissing, no_update_before_unscale

    finding = no_update_before_unscale(UpdateMissing(
        RungId.SKIPS, "fp16", "unscale_() has already been called", 1, 2, location=LINE))
    assert (finding.kind, finding.severity) == (KindId.LOOP_ERROR, Severity.ERROR)
    assert (finding.evidence["measured"], finding.evidence["expected"]) == (1, 2)
    assert "never reached scaler.update()" in finding.message
    assert "on every path" in finding.fix and "timeout" not in finding.fix


# --- the ddp-sync rung's observations (kinds.sync, kinds.mismatch, kinds.accumulation) -------

def _ranks(**changes):
    from ampdoctor.kinds.sync import RanksCompared
    numbers = {"rank": 1, "step": 0, "ratio": 0.75, "cosine": 0.9987654, "relative_error": 0.25,
               "max_difference": 0.0, "first_apart": None, "parameter_difference": 0.0,
               "world_size": 2}
    return RanksCompared(**{**numbers, **changes})


@pytest.mark.parametrize("who, update_right, severity", [
    ("DDP", True, Severity.ERROR),          # DDP's K-fold all-reduce saves nothing
    ("FSDP", True, Severity.WARNING),       # FSDP2's documented trade while the update is right
    ("FSDP", False, Severity.ERROR)])
def test_syncing_every_micro_batch_is_a_warning_only_for_fsdp2_with_a_right_update(
        who, update_right, severity):
    from ampdoctor.kinds.sync import TooManySyncs, too_many_syncs
    K, windows, one_sync = 4, 3, 2308
    total = K * windows * one_sync                       # every backward synced
    finding = too_many_syncs(TooManySyncs(
        RungId.DDP_SYNC, who, synced=K * windows, backwards=K * windows, windows=windows,
        per_window=K, total_bytes=total, one_sync_bytes=one_sync, world_size=2,
        sharded=who == "FSDP", update_right=update_right, worst=3e-7, location=LINE))
    assert (finding.kind, finding.severity) == (KindId.MISSING_NO_SYNC, severity)
    per_window = total / windows
    assert finding.evidence["measured"] == K and finding.evidence["expected"] == 1.0
    assert finding.evidence["bytes_per_window"] == per_window
    verb = "all-reduced" if who == "DDP" else "reduce-scattered"
    assert finding.message.startswith(
        f"{who} {verb} gradients on 12 of 12 backward passes for 3 optimizer steps (4 per "
        f"step): {per_window:,.0f} bytes per window against the 2,308 a single sync needs.")
    assert ("documented sync-on-every-micro-batch mode" in finding.message) is (
        severity is Severity.WARNING)
    if who == "DDP":
        assert finding.evidence["allreduces_per_window"] == K
        assert finding.message.endswith("The first K-1=3 micro-batches of each window need "
                                        "model.no_sync() (or require_backward_grad_sync = "
                                        "False).")


def test_a_sync_on_the_third_of_four_backwards_names_the_position_and_the_ratio():
    from ampdoctor.kinds.sync import SyncOnWrongBackward, sync_on_wrong_backward
    ratio = 3 / 4                             # three of four micro-batches reached the update
    finding = sync_on_wrong_backward(SyncOnWrongBackward(
        RungId.DDP_SYNC, "DDP", position=3, per_window=4, positions=(3, 3, 3), apart=False,
        ranks=_ranks(ratio=ratio), location=LINE))
    assert (finding.kind, finding.severity) == (KindId.MISSING_NO_SYNC, Severity.ERROR)
    assert (finding.evidence["measured"], finding.evidence["expected"]) == (3, 4)
    assert finding.evidence["synced_backward_in_window"] == [3, 3, 3]
    assert finding.evidence["ratio"] == ratio and finding.evidence["rank"] == 1
    assert finding.message == (
        "DDP all-reduced once per window, but on backward 3 of 4, not the last: the later "
        "micro-batches' gradients stayed rank-local and out of the window's update. Rank 1 "
        "consumed 0.75x the reference gradient of the global batch (cosine 0.9988) at step 0.")


def test_hsdp_all_reducing_early_and_never_are_two_kinds():
    from ampdoctor.kinds.mismatch import ReplicasNeverAllReduced, replicas_never_all_reduced
    from ampdoctor.kinds.sync import ReplicasAllReducedLate, replicas_all_reduced_late
    late = replicas_all_reduced_late(ReplicasAllReducedLate(
        RungId.DDP_SYNC, position=(6 - 1) % 4 + 1, per_window=4, missed=(0, 1),
        replica_all_reduces=2, ranks=_ranks()))
    assert late.kind == KindId.MISSING_NO_SYNC and late.evidence["measured"] == 2
    assert "on backward 2 of 4, not the window's last (window(s) 0, 1)" in late.message
    never = replicas_never_all_reduced(ReplicasNeverAllReduced(
        RungId.DDP_SYNC, windows=3, missed=(0, 1, 2), stepped=0, steps_judged=3,
        ranks=_ranks()))
    assert (never.kind, never.severity) == (KindId.GRADIENT_MISMATCH, Severity.ERROR)
    assert (never.evidence["measured"], never.evidence["expected"]) == (0, 3)
    assert never.evidence["windows_not_all_reduced"] == [0, 1, 2]
    assert "rank 0 consumed a gradient at 0 of its 3 optimizer steps" in never.message
    assert "set_requires_all_reduce(i % K == K - 1)" in never.fix


@pytest.mark.parametrize("sharded", [False, True])
def test_ranks_that_never_synced_drift_or_never_step(sharded):
    from ampdoctor.kinds.mismatch import NeverSynced, never_synced
    drift = abs(1.25 - 1.0) / 1.0
    finding = never_synced(NeverSynced(
        RungId.DDP_SYNC, "FSDP" if sharded else "DDP", sharded=sharded, windows=3,
        stepped=0 if sharded else 3, steps_judged=3,
        ranks=_ranks(parameter_difference=drift)))
    assert (finding.kind, finding.severity) == (KindId.GRADIENT_MISMATCH, Severity.ERROR)
    assert finding.evidence["steps_with_a_gradient"] == (0 if sharded else 3)
    assert ("no rank stepped at all" in finding.message) is sharded
    assert ("the ranks' parameters ended 0.25 apart" in finding.message) is not sharded
    assert bool(finding.fix != CATALOGUE[KindId.GRADIENT_MISMATCH].fix) is sharded


def test_ranks_apart_name_where_their_calls_part():
    from ampdoctor.kinds.mismatch import RanksApart, ranks_apart
    apart = abs(0.4 - 0.1) / 0.1 * 0.1       # 0.3 of the reference norm, written here
    finding = ranks_apart(RanksApart(
        RungId.DDP_SYNC, "DDP", _ranks(rank=0, max_difference=apart, first_apart=1,
                                       parameter_difference=0.0123),
        other_rank=1, parted=("a clip call that only one of them makes", "train.py", 12),
        location=LINE))
    assert finding.kind == KindId.GRADIENT_MISMATCH
    assert finding.evidence["measured"] == round(apart, 6) and finding.evidence["expected"] == 0
    assert finding.message.startswith(f"The ranks consumed different gradients ({apart:.3g} "
                                      "apart, relative, first at step 1)")
    assert finding.message.endswith("(0.0123 after the run). Rank 0 and rank 1 part ways at a "
                                    "clip call that only one of them makes (train.py:12).")


def test_a_loss_over_the_world_size_is_a_double_average_with_the_unclipped_ratio():
    from ampdoctor.kinds.accumulation import DividedByWorldSize, divided_by_world_size
    world_size = 4
    ratio = 1 / world_size
    finding = divided_by_world_size(DividedByWorldSize(
        RungId.DDP_SYNC, "DDP", ratio, _ranks(world_size=world_size, ratio=0.05,
                                              ratio_before_clip=ratio)))
    assert (finding.kind, finding.severity) == (KindId.DOUBLE_AVERAGE, Severity.ERROR)
    assert finding.evidence["measured"] == 0.25
    assert finding.evidence["ratio"] == 0.05 and finding.evidence["ratio_before_clip"] == 0.25
    assert finding.message.startswith("Every rank consumed 0.25x the reference gradient of the "
                                      "global batch: 1/world_size (=0.25). DDP already averages")


# --- a process the watchdog killed or saw die (kinds.loop_error) -----------------------------

@pytest.mark.parametrize("precision", [None, "fp16"])
def test_a_killed_process_says_its_bound_where_it_was_and_its_last_progress(precision):
    from ampdoctor.kinds.loop_error import ProcessKilled, process_killed
    elapsed = 12.5 + 0.76                                # killed a little after its bound
    finding = process_killed(ProcessKilled(
        RungId.FP32_ACCUM, "ddp.timeout_s", 12.5, elapsed, location=Location("train.py", 12),
        function="step", progressed=True, last_precision=precision, last_step=2, steps=3))
    assert (finding.kind, finding.severity) == (KindId.LOOP_ERROR, Severity.ERROR)
    assert finding.evidence == {"ddp.timeout_s": 12.5, "measured": round(elapsed, 1),
                                "expected": None, "killed_after_s": round(elapsed, 1),
                                "last_precision": precision, "last_step": 2}
    assert "within ddp.timeout_s = 12.5 s" in finding.message
    assert "killed after 13 s. It was at train.py:12 (step)." in finding.message
    assert ("Its last progress was the fp16 run at optimizer step 2/3." in finding.message) is (
        precision is not None)
    assert finding.title == "The loop did not stop"


@pytest.mark.parametrize("status, signal_name, how", [
    (-9, "SIGKILL", "was killed by SIGKILL"), (1, None, "exited with status 1")])
def test_a_process_that_died_says_how(status, signal_name, how):
    from ampdoctor.kinds.loop_error import ProcessDied, process_died
    died = ProcessDied(RungId.FP16_SCALER, status, signal_name)
    finding = process_died(died)
    assert finding.severity is Severity.ERROR and finding.evidence["exit_status"] == status
    assert finding.message.startswith(f"The process running the loop {how} during the "
                                      "fp16-scaler rung, before ampdoctor could write")
    assert ProcessDied("loading", status, signal_name).message.startswith(
        f"The process running the loop {how} while loading the spec's code")


# --- a script's learning rate against its reference's (kinds.mismatch) -----------------------

@pytest.mark.parametrize("scheduled, says", [
    (False, "not from the optimizer step's batch of K x b = 4 x 8"),
    (True, "its schedule (warm-up, length) from the number of micro-batches")])
def test_a_rate_off_the_reference_is_an_error_with_the_ratio(scheduled, says):
    from ampdoctor.kinds.mismatch import RateOffReference, rate_off_reference
    run_lr, ref_lr = 1e-3 * 8 / 256, 1e-3 * 32 / 256        # scaled by b, not by K x b
    ratio = run_lr / ref_lr
    finding = rate_off_reference(RateOffReference(
        RungId.FP32_ACCUM, 0, 0, run_lr, ref_lr, "--accum_iter 1 --batch_size 32", K=4,
        micro_batch_size=8, scheduled=scheduled, location=LINE))
    assert (finding.kind, finding.severity) == (KindId.GRADIENT_MISMATCH, Severity.ERROR)
    assert finding.evidence == {"measured": round(ratio, 6), "expected": 1.0, "step": 0,
                                "lr_used": run_lr, "lr_expected": ref_lr}
    assert finding.message.startswith(
        f"Step 0: the optimizer's learning rate is {run_lr:.6g} in the run and {ref_lr:.6g} "
        f"in the reference (--accum_iter 1 --batch_size 32), {ratio:.4g}x: ")
    assert says in finding.message


def test_a_reference_rate_of_zero_gives_an_infinite_ratio_as_text():
    from ampdoctor.kinds.mismatch import RateOffReference, rate_off_reference
    finding = rate_off_reference(RateOffReference(RungId.FP32_ACCUM, 2, 1, 1e-3, 0.0, "", 4,
                                                  None, scheduled=True))
    assert finding.evidence["measured"] == "inf"
    assert "learning rate (parameter group 1) is 0.001" in finding.message


# --- loss-scale owners the static scan found (kinds.double_scaling) --------------------------

OWNERS = ({"kind": "GradScaler", "file": "train.py", "line": 12},
          {"kind": "GradScaler", "file": "train.py", "line": 30})


@pytest.mark.parametrize("untold", [None, "NONE_ENABLED", "UNUSED"])
def test_owners_on_one_path_are_an_error_unless_the_runs_could_not_tell(untold):
    from ampdoctor.kinds.double_scaling import OwnersOnOnePath, Untold, owners_on_one_path
    why = Untold[untold] if untold else None
    finding = owners_on_one_path(OwnersOnOnePath(
        RungId.DOUBLE_SCALING, OWNERS, "/p/train.py", "train.py",
        ("GradScaler at train.py:12", "GradScaler at train.py:30"), untold=why))
    assert finding.kind == KindId.DOUBLE_SCALING
    assert finding.severity is (Severity.WARNING if why else Severity.ERROR)
    assert (finding.evidence["measured"], finding.evidence["expected"]) == (len(OWNERS), 1)
    assert finding.evidence["scope"] == "same-path"
    assert finding.message == ("2 loss-scale owners on one training path (entry point "
                               "train.py): GradScaler at train.py:12; GradScaler at "
                               "train.py:30." + (why.value if why else ""))


def test_owners_in_separate_entry_points_are_a_warning_naming_them_all():
    from ampdoctor.kinds.double_scaling import OwnersApart, owners_apart
    finding = owners_apart(OwnersApart(
        RungId.DOUBLE_SCALING, OWNERS,
        (("GradScaler at a.py:3", ("a.py",)), ("DeepSpeed fp16 at ds.json", ("b.py", "c.py"))),
        entries=("c.py", "a.py", "b.py")))
    assert finding.severity is Severity.WARNING
    assert finding.evidence["entries"] == ["a.py", "b.py", "c.py"]
    assert finding.message.startswith(
        "2 loss-scale owners of different kinds in separate entry points: GradScaler at "
        "a.py:3 (entry point a.py); DeepSpeed fp16 at ds.json (entry point b.py, c.py).")


# --- gradient-mismatch: a framework update that is not what its config asks for -------------

CONFIG_KEY = Location("ds_config.json", 5, None, '"initial_scale_power": 15,')


def test_an_engine_update_off_by_its_loss_scale_names_the_config_key():
    """DeepSpeed's ZeRO-0 fp16 path (upstream PR #8393): the optimizer divides by the loss scale
    engine.backward never applied, so the consumed gradient is 1/S of the reference's."""
    from ampdoctor.kinds.mismatch import EngineScaleOff, engine_scale_off
    scale = 2.0 ** 15
    consumed, reference = 1.0 / scale, 1.0        # the two norms
    ratio = consumed / reference
    finding = engine_scale_off(EngineScaleOff(
        RungId.FP16_SCALER, 0, "fp16", ratio, 0.99999, scale, 1 / scale,
        "fp16.initial_scale_power", 1e-2, {"rel_err": 1 - ratio}, location=CONFIG_KEY))
    assert (finding.kind, finding.severity) == (KindId.GRADIENT_MISMATCH, Severity.ERROR)
    assert finding.location == CONFIG_KEY            # the config key, not the loss line
    assert finding.evidence["measured"] == float(f"{ratio:.6g}")
    assert finding.evidence["expected"] == 1.0
    assert finding.evidence["factor"] == "1/32768"
    assert finding.evidence["loss_scale"] == scale
    assert finding.evidence["config_key"] == "fp16.initial_scale_power"
    assert "which is 1/32768: the engine's own loss scale (2^15, from " \
           "`fp16.initial_scale_power`)" in finding.message
    assert "unscaled a loss it never scaled" in finding.message


@pytest.mark.parametrize("precision, scale, ratio, cosine, factor", [
    ("fp16", 2.0 ** 16, 1.0 / 2 ** 16 * 1.01, 0.99999, 1 / 2 ** 16),   # 1/S within fp16 noise
    ("fp16", 256.0, 256.0 * 0.98, 0.9999, 256.0),                      # S: never unscaled
    ("fp16", 2.0 ** 16, 0.25, 0.99999, None),                          # 1/K: not the engine's
    ("fp16", 2.0 ** 16, 1.0 / 2 ** 16, 0.9, None),                     # another direction
    ("fp16", 1.0, 1.0, 0.99999, None),                                 # no scale to blame
    ("bf16", 0.0, 1.0 / 2 ** 16, 0.99999, None),                       # no fp16 engine
])
def test_the_engines_scale_factor_is_matched_only_to_the_engines_own_scale(
        precision, scale, ratio, cosine, factor):
    from ampdoctor.probe.events import EngineBuilt
    from ampdoctor.rules.deepspeed import scale_factor
    engine = EngineBuilt(seq=0, microbatch=0, backwards=0, site=None, precision=precision,
                         loss_scale=scale,
                         loss_scale_key="fp16.initial_scale_power")
    assert scale_factor(engine, ratio, cosine) == factor


# --- the static scan's hints (kinds.schedule, kinds.stepping, kinds.accumulation, clipping) ---

MODULO_LOOP = dict(line=20, step_line=24, k="accum_steps", test="(i + 1) % accum_steps == 0",
                   test_line=23)


def _scan_site(line, code):
    return Location("train.py", line, "train", code)


@pytest.mark.parametrize("tested", [True, False])
def test_a_scheduler_stepped_in_the_accumulation_loop_is_a_warning_naming_k_and_the_step(tested):
    from ampdoctor.kinds.base import AccumulationLoop
    from ampdoctor.kinds.schedule import SchedulerInLoop, scheduler_in_loop
    loop = (AccumulationLoop(**MODULO_LOOP) if tested
            else AccumulationLoop(line=20, step_line=31))      # K not shown, step after the loop
    k = "accum_steps" if tested else "K"
    where = ("only on the iterations `(i + 1) % accum_steps == 0` selects (line 23; the step at "
             "line 24)" if tested else "after the loop (line 31)")
    site = _scan_site(22, "sched.step()")
    finding = scheduler_in_loop(SchedulerInLoop(22, "sched.step()", loop, site))
    assert (finding.rung, finding.kind, finding.severity) == (
        "scan", KindId.SCHEDULER_PER_MICROBATCH, Severity.WARNING)
    assert finding.message == (
        f"`sched.step()` at line 22 runs on every micro-batch in the accumulation loop at line "
        f"20, where the optimizer steps {where}: the schedule advances {k} times per optimizer "
        f"step, so warmup and decay run {k} times too fast.")
    assert finding.evidence == {"static": True, "loop_line": 20,
                                "accumulation": "accum_steps" if tested else None}
    assert finding.location == site
    assert finding.title == "scheduler.step() on every micro-batch"
    assert finding.fix == CATALOGUE[KindId.SCHEDULER_PER_MICROBATCH].fix


def test_zero_grad_in_the_accumulation_loop_is_a_warning_that_says_what_it_wipes():
    from ampdoctor.kinds.base import AccumulationLoop
    from ampdoctor.kinds.stepping import ZeroGradInLoop, zero_grad_in_loop
    site = _scan_site(21, "opt.zero_grad()")
    finding = zero_grad_in_loop(ZeroGradInLoop(21, "opt.zero_grad()",
                                               AccumulationLoop(**MODULO_LOOP), site))
    assert (finding.kind, finding.severity) == (KindId.ZERO_GRAD_INSIDE_ACCUMULATION,
                                                Severity.WARNING)
    assert finding.message.startswith("`opt.zero_grad()` at line 21 runs on every micro-batch "
                                      "in the accumulation loop at line 20, ")
    assert finding.message.endswith(": it wipes the gradients the window's earlier "
                                    "micro-batches accumulated, so the optimizer step sees only "
                                    "the last one.")
    assert finding.evidence == {"static": True, "loop_line": 20, "accumulation": "accum_steps"}
    assert finding.location == site
    assert finding.title == "zero_grad() on every micro-batch of the accumulation window"


def test_a_loss_divided_by_nothing_is_a_warning_that_says_k_times_the_mean():
    from ampdoctor.kinds.accumulation import UndividedLoss, undivided_loss
    from ampdoctor.kinds.base import AccumulationLoop
    loop = AccumulationLoop(line=40, step_line=45, k="4", test="step % 4 == 0", test_line=44)
    site = _scan_site(43, "scaler.scale(loss).backward()")
    finding = undivided_loss(UndividedLoss(43, "scaler.scale(loss).backward()", "loss", loop,
                                           site))
    assert (finding.kind, finding.severity) == (KindId.MISSING_ACCUMULATION_AVERAGE,
                                                Severity.WARNING)
    assert finding.message == (
        "`loss` reaches `backward()` at line 43 in the accumulation loop at line 40, where the "
        "optimizer steps only on the iterations `step % 4 == 0` selects (line 44; the step at "
        "line 45), and it is divided by nothing on the way: each optimizer step gets the sum of "
        "4 micro-batch gradients, 4 times the mean. Divide it by 4 before backward (or confirm "
        "that what builds it already does).")
    assert finding.evidence == {"static": True, "loop_line": 40, "accumulation": "4"}
    assert finding.location == site


def test_a_clip_between_the_scaled_backward_and_the_step_is_a_warning_naming_both_lines():
    from ampdoctor.kinds.clipping import ClipInCode, clip_in_code
    code = "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
    site = _scan_site(52, code)
    finding = clip_in_code(ClipInCode(52, code, "clip_grad_norm_", "amp_scaler", 50,
                                      "amp_scaler.step(opt)", 53, site))
    assert (finding.rung, finding.kind, finding.severity) == (
        "scan", KindId.CLIP_BEFORE_UNSCALE, Severity.WARNING)
    assert finding.message == (
        "`clip_grad_norm_` at line 52 runs after `amp_scaler.scale(...).backward()` (line 50) "
        "and before `amp_scaler.step(opt)` (line 53) with no `amp_scaler.unscale_(...)` in "
        "between: in fp16 it clips gradients still multiplied by the loss scale, so the "
        "threshold means max_norm x scale (or the update is crushed by 1/scale). Call "
        "`amp_scaler.unscale_(optimizer)` right before it.")
    assert finding.evidence == {"static": True, "backward_line": 50, "step_line": 53}
    assert finding.location == site
    assert finding.title == ("clip_grad_norm_ between scaler.scale(...).backward() and "
                             "scaler.step() without unscale_")
