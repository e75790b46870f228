"""Each decider's severity boundary and text from a hand-built observation.

The numbers an observation carries are computed here, independently of ampdoctor (a rate is
skips / steps, a speed-up 1 / (1 - rate), a shifted learning rate read off the schedule by
hand), and each test sits on one side of one boundary. No loop runs; the end-to-end recipes
(tests/test_e2e_diagnose.py, tests/test_frameworks.py, tests/test_script_mode.py) check the same
kinds from a real run.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ampdoctor.core import thresholds
from ampdoctor.core.enums import KindId, Severity
from ampdoctor.core.findings import Location
from ampdoctor.kinds import CATALOGUE, ERROR_WHEN, FRAMEWORK_FIXES
from ampdoctor.kinds.accumulation import double_average, missing_accumulation_average
from ampdoctor.kinds.base import FORCED_FP16, Observed, skip_severity
from ampdoctor.kinds.schedule import (
    ScheduleOnSkips,
    schedule_on_skips,
    scheduler_per_microbatch,
)
from ampdoctor.kinds.stepping import step_per_microbatch, zero_grad_inside_accumulation
from ampdoctor.kinds.sync import sync_on_every_micro_batch
from ampdoctor.probe.events import SchedulerStep, make_event
from ampdoctor.rules.schedule import lr_shift

SITE = Location("train.py", 40, "train_loop", "scheduler.step()")


def _shift(calibration: int = 0, steady: int = 0, after: int = 7, lr_shift: float = 0.0,
           own_scaler: bool = True, framework: str | None = None) -> ScheduleOnSkips:
    steps = calibration + 1 + after
    return ScheduleOnSkips("skips", "LambdaLR", SITE, calibration_skips=calibration,
                           steady_skips=steady, steps_after_settling=after,
                           scheduler_steps=steps, real_updates=steps - calibration - steady,
                           lr_shift=lr_shift, lr_step=2 if lr_shift else None,
                           lr_used=0.03 if lr_shift else None,
                           lr_meant=0.02 if lr_shift else None, tolerance=0.05,
                           own_scaler=own_scaler, framework=framework)


# --- scheduler-steps-on-skip ----------------------------------------------------------------

def test_no_own_skip_is_no_finding():
    """The injected skip alone shifts nothing in the user's training."""
    assert schedule_on_skips(_shift()) is None


def test_skips_that_persist_after_the_scale_settled_are_an_error_with_the_rate():
    finding = schedule_on_skips(_shift(steady=3, after=7))
    assert finding is not None
    assert (finding.kind, finding.severity) == (KindId.SCHEDULER_STEPS_ON_SKIP, Severity.ERROR)
    rate = 3 / 7
    assert finding.evidence["measured"] == pytest.approx(rate, abs=1e-6)
    assert finding.evidence["steady_skips"] == 3
    assert f"skipped 3 of the 7 steps that followed (a steady skip rate of {rate:.0%})" \
        in finding.message
    assert f"runs {1 / (1 - rate):.3g}x too fast" in finding.message       # 1.75x
    assert f"ends after {10_000 * (1 - rate):,.0f} real updates" in finding.message  # 5,714
    assert finding.location == SITE
    assert finding.fix == CATALOGUE[KindId.SCHEDULER_STEPS_ON_SKIP].fix


@pytest.mark.parametrize("after, severity", [
    # 2 skips: 2/99 = 2.02 % is above SCHEDULER_SKIP_RATE (2 %), 2/101 = 1.98 % is not
    (99, Severity.ERROR), (101, Severity.WARNING)])
def test_the_steady_rate_boundary(after, severity):
    assert 2 / 99 > thresholds.SCHEDULER_SKIP_RATE > 2 / 101
    finding = schedule_on_skips(_shift(steady=2, after=after))
    assert finding is not None and finding.severity == severity


def test_one_skip_after_settling_is_not_yet_a_rate():
    """1 of 2 is 50 %, but one overflow is what a growth_interval costs: fewer than
    MIN_COUNTED_SKIPS, and a shift within tolerance, stays a warning."""
    finding = schedule_on_skips(_shift(steady=1, after=2, lr_shift=0.0))
    assert finding is not None and finding.severity == Severity.WARNING


def test_calibration_skips_are_a_warning_that_names_their_count():
    finding = schedule_on_skips(_shift(calibration=2, lr_shift=0.0))
    assert finding is not None and finding.severity == Severity.WARNING
    assert "advanced on the 2 skip(s) of the scale's calibration" in finding.message
    assert finding.evidence["calibration_skips"] == 2 and finding.evidence["measured"] == 0.0


def test_calibration_skips_stay_a_warning_before_any_shift_after_them():
    """The calibration's shift is the schedule's start: with no skip after it nothing moved."""
    finding = schedule_on_skips(_shift(calibration=5, lr_shift=0.0))
    assert finding is not None and finding.severity == Severity.WARNING
    assert "starts 5 step(s) ahead of the real updates" in finding.message


@pytest.mark.parametrize("shift, severity", [(0.051, Severity.ERROR),
                                             (0.049, Severity.WARNING)])
def test_a_skip_after_calibration_that_moves_an_lr_beyond_tolerance_is_an_error(shift, severity):
    """One skip (no rate yet): the real update's lr moved with it by 5.1 % / 4.9 % against the
    rung's rtol 0.05."""
    finding = schedule_on_skips(_shift(calibration=2, steady=1, lr_shift=shift))
    assert finding is not None and finding.severity == severity
    if severity == Severity.ERROR:
        assert "Real update 2 used lr 0.03 where the schedule (after the calibration) gives " \
            "0.02" in finding.message
        assert f"({shift:.1%} off, beyond the rung's tolerance 0.05)" in finding.message
    else:
        assert f"(largest {shift:.2%}, tolerance 0.05)" in finding.message
    assert "the 2 skip(s) of the scale's calibration shift the schedule" in finding.message


def test_every_update_skipped_after_settling_says_so():
    finding = schedule_on_skips(_shift(steady=3, after=3))
    assert finding is not None and "the schedule runs on while no update is made" in \
        finding.message


def test_a_run_forced_into_fp16_is_told_what_fp16_would_do_not_failed():
    finding = schedule_on_skips(_shift(steady=3, after=7, lr_shift=0.5,
                                                own_scaler=False))
    assert finding is not None and finding.severity == Severity.WARNING
    assert finding.message.endswith(FORCED_FP16)
    assert finding.evidence["own_precision_scaled"] is False


def test_accelerate_fix_says_prepare_the_scheduler():
    finding = schedule_on_skips(_shift(steady=3, framework="accelerate"))
    assert finding is not None and "accelerator.prepare" in finding.fix
    assert finding.evidence["framework"] == "accelerate"


@pytest.mark.parametrize("consequence, own, severity", [
    (True, True, Severity.ERROR), (True, False, Severity.WARNING),
    (False, True, Severity.WARNING), (False, False, Severity.WARNING)])
def test_skip_severity(consequence, own, severity):
    assert skip_severity(consequence, own_scaler=own) == severity


# --- the shifted learning rate, measured on a trace ------------------------------------------

def _trace(order: str, lrs: list[float]):
    """`f` forward, `k` a skipped scaler.step, `o` an applied one (with its optimizer step),
    `s` a scheduler step whose lr is the next of `lrs` (lrs[0] is the lr before any)."""
    events, steps, lr = [], [], iter(lrs)
    before = next(lr)
    for seq, c in enumerate(order):
        if c == "f":
            events.append(make_event("forward", seq, index=seq))
        elif c in "ko":
            events.append(make_event("scaler_step", seq, enabled=True, skipped=c == "k"))
            if c == "o":
                steps.append(SimpleNamespace(optimizer=0, group=len(steps), seq=seq))
        else:
            after = next(lr)
            events.append(make_event("scheduler", seq, optimizer=0, scheduler=1, lr=after,
                                     lr_before=before, scheduler_type="LambdaLR"))
            before = after
    return SimpleNamespace(events=events, steps=steps,
                           events_of=lambda cls: [e for e in events if isinstance(e, cls)])


def test_lr_shift_takes_the_calibration_as_the_schedules_start():
    """A warmup 0.01, 0.02, ...: two calibration skips the scheduler advanced on, then two real
    updates that used 0.03 and 0.04. From the run's start they are 0.02 ahead; from where the
    calibration left the schedule, on time."""
    lrs = [0.01, 0.02, 0.03, 0.04, 0.05]
    trace = _trace("fks" "fks" "fos" "fos", lrs)
    events = trace.events_of(SchedulerStep)
    shift, step, used, meant = lr_shift(trace, events, 0)
    assert (step, used, meant) == (0, 0.03, 0.01)
    assert shift == pytest.approx((0.03 - 0.01) / 0.01)
    assert lr_shift(trace, events, 0, start_shift=2) == (0.0, None, None, None)


def test_lr_shift_of_a_skip_after_calibration():
    """Updates 0 and 1 around a skip the scheduler advanced on: update 1 used 0.03 where the
    schedule gives 0.02 for the second real update."""
    trace = _trace("fos" "fks" "fos", [0.01, 0.02, 0.03, 0.04])
    shift, step, used, meant = lr_shift(trace, trace.events_of(SchedulerStep), 0)
    assert (step, used, meant) == (1, 0.03, 0.02)
    assert shift == pytest.approx(0.5)


def test_lr_shift_of_a_skip_aware_scheduler_is_zero():
    trace = _trace("fk" "fos" "fos", [0.01, 0.02, 0.03])
    events = trace.events_of(SchedulerStep)
    assert lr_shift(trace, events, 0)[0] == 0.0


# --- fix text in the framework's terms ----------------------------------------------------------

def _observed(framework: str | None = None, fix: str = "") -> Observed:
    evidence = {"measured": 0.25, "expected": 1.0}
    if framework is not None:
        evidence["framework"] = framework
    return Observed("fp32-accum", Severity.ERROR, "m", evidence=evidence, fix=fix)  # type: ignore[arg-type]


@pytest.mark.parametrize("decider, kind", [
    (double_average, "double-average"),
    (missing_accumulation_average, "missing-accumulation-average"),
    (step_per_microbatch, "step-per-microbatch"),
    (zero_grad_inside_accumulation, "zero-grad-inside-accumulation"),
    (scheduler_per_microbatch, "scheduler-per-microbatch")])
@pytest.mark.parametrize("framework", ["accelerate", "Lightning", "Fabric"])
def test_accumulation_fix_is_said_in_the_frameworks_terms(decider, kind, framework):
    finding = decider(_observed(framework))
    assert finding.fix == FRAMEWORK_FIXES[(kind, framework)]
    assert finding.fix != CATALOGUE[kind].fix


FRAMEWORKS = ("accelerate", "HF Trainer", "Lightning", "Fabric")


@pytest.mark.parametrize("kind", ["double-average", "missing-accumulation-average",
                                  "reduction-mismatch", "weighted-average-mismatch"])
def test_every_division_kind_has_a_fix_in_every_frameworks_terms(kind):
    assert all((kind, framework) in FRAMEWORK_FIXES for framework in FRAMEWORKS)


def test_the_division_fixes_name_who_divides():
    fixes = FRAMEWORK_FIXES
    # accelerate divides: the loop's own division goes (the catalogue says keep `loss / K`)
    assert fixes[("double-average", "accelerate")].startswith("Remove your own division")
    assert "keep `loss" in CATALOGUE["double-average"].fix
    # Fabric does not divide: the loop divides once, before fabric.backward
    assert "fabric.backward(loss / K)" in fixes[("missing-accumulation-average", "Fabric")]
    assert "fabric.backward(loss / K)" in fixes[("double-average", "Fabric")]
    # Lightning divides in automatic optimization only
    assert "Return the plain loss" in fixes[("double-average", "Lightning")]
    assert "manual_backward(loss / N)" in fixes[("missing-accumulation-average", "Lightning")]
    # the Trainer with loss kwargs divides by nothing: the loss divides by num_items_in_batch
    assert "num_items_in_batch" in fixes[("missing-accumulation-average", "HF Trainer")]
    assert "Remove the division" in fixes[("double-average", "HF Trainer")]


def test_without_a_framework_or_with_the_rules_own_fix_the_table_stays_out():
    assert double_average(_observed()).fix == CATALOGUE["double-average"].fix
    assert double_average(_observed("accelerate", fix="own")).fix == "own"
    # a framework the table does not know (DeepSpeed has its own entries since issue 38)
    assert double_average(_observed("Megatron")).fix == CATALOGUE["double-average"].fix
    assert "scale_wrt_gas" in double_average(_observed("DeepSpeed")).fix


# --- missing-no-sync: FSDP2's documented trade ------------------------------------------------

@pytest.mark.parametrize("sharded, update_right, severity", [
    (True, True, Severity.WARNING), (True, False, Severity.ERROR),
    (False, True, Severity.ERROR), (False, False, Severity.ERROR)])
def test_sync_on_every_micro_batch(sharded, update_right, severity):
    seen = replace(_observed(), rung="ddp-sync")
    finding = sync_on_every_micro_batch(seen, sharded=sharded,
                                                 update_right=update_right)
    assert (finding.kind, finding.severity) == (KindId.MISSING_NO_SYNC, severity)


# --- the docs say what the deciders decide ----------------------------------------------------

def _kind_sections() -> dict[str, str]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "kinds.md").read_text()
    parts = re.split(r"^## `([a-z0-9-]+)`\s*$", text, flags=re.MULTILINE)
    return {parts[i]: " ".join(parts[i + 1].split()) for i in range(1, len(parts), 2)}


@pytest.mark.parametrize("kind", sorted(CATALOGUE))
def test_kinds_md_states_each_kinds_error_consequence(kind):
    assert f"**Error when**: {' '.join(ERROR_WHEN[kind].split())}" in _kind_sections()[kind]


# --- whose precision the skips rung judges ----------------------------------------------------

def _session(precisions=("fp32", "bf16", "fp16"), scalers=None, autocasts=None):
    trace = SimpleNamespace() if scalers is None else SimpleNamespace(
        outcome=SimpleNamespace(scalers=scalers, autocasts=autocasts or []))
    return SimpleNamespace(spec=SimpleNamespace(precisions=list(precisions)),
                           trace=lambda precision: trace)


@pytest.mark.parametrize("session, scaled", [
    # spec mode: the spec's precisions say it
    (_session(), True), (_session(("fp32", "bf16")), False),
    # script mode: what the script built when left alone (its fp32 run records it)
    (_session(scalers=[{"enabled": True}]), True),
    (_session(scalers=[{"enabled": False}],
              autocasts=[{"enabled": True, "dtype": "bfloat16", "device": "cuda"}]), False),
    (_session(scalers=[], autocasts=[{"enabled": True, "dtype": "float16", "device": "cpu"}]),
     True),
    (_session(scalers=[], autocasts=[{"enabled": True, "dtype": None, "device": "cuda"}]), True),
    (_session(scalers=[], autocasts=[{"enabled": True, "dtype": None, "device": "cpu"}]), False),
    (_session(scalers=[{"enabled": False}],
              autocasts=[{"enabled": False, "dtype": "float16", "device": "cuda"}]), False)])
def test_own_precision_scaled(session, scaled):
    from ampdoctor.ladder.skips import own_precision_scaled
    assert own_precision_scaled(session) is scaled


def test_kinds_md_error_when_is_generated_from_the_units():
    """`python -m ampdoctor.kinds.docs docs/kinds.md` rewrites the bullets from the units: the
    page as committed is what it writes, and a unit's changed text is caught."""
    from ampdoctor.kinds import docs as kind_docs
    page = (Path(__file__).resolve().parents[1] / "docs" / "kinds.md").read_text()
    assert kind_docs.disagreeing(page) == []
    assert kind_docs.synced(page) == page
    stale = page.replace("no later comparison could mean anything", "nothing", 1)
    assert kind_docs.disagreeing(stale) == [KindId.NONDETERMINISTIC_BASELINE]
