"""Verdicts on ordinary (non-framework) loops that used to come out wrong:

1. a scheduler stepped every micro-batch whose warm-up is over inside the first window was
   forgiven as an "offset": only scheduler steps taken before the run's first forward are one;
2. a missing / K under a clip that bites, with the weighting wrong as well, was named by a
   ratio that is not K (or not at all: `gradient-mismatch`): the K is read before the clip,
   against the micro-batch gradients the loop summed, and the message names both mistakes;
3. a GradScaler that keeps skipping after its first real update drops updates the reference
   makes: an error, where the skips of the scale settling stay tolerated.

Each with its broken recipe run through the real CLI (kind, rung, numbers, file:line) and
healthy loops that must stay clean.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ampdoctor.probe.events import make_event
from ampdoctor.rules import scheduler_findings
from ampdoctor.rules.skip_rate import frequent_skips
from conftest import CONFIGS, RECIPES, marked_line, run_cli


def _group(name):
    return pytest.mark.xdist_group(name)


def _configs(*names):
    """Parameters on the worker that diagnoses (and caches) each config, as in
    test_e2e_diagnose."""
    return [pytest.param(n, marks=[_group(n)]) for n in names]


def _failed_at(result, rung: str, kind: str, recipe: str) -> dict:
    """The record failed at `rung` with a `kind` error at the recipe's marked line, and the
    rungs after it did not run."""
    record = result.record
    assert result.returncode == 1, result.stderr
    assert record["verdict"] == "failed" and record["failed_rung"] == rung, record["rungs"]
    finding = record["findings"][0]
    assert (finding["kind"], finding["rung"], finding["severity"]) == (kind, rung, "error"), \
        record["findings"]
    marker = RECIPES / recipe
    assert Path(finding["location"]["file"]).resolve() == marker.resolve()
    assert finding["location"]["line"] == marked_line(marker, kind)
    statuses = [r["status"] for r in record["rungs"]]
    at = [r["id"] for r in record["rungs"]].index(rung)
    assert statuses[at] == "fail" and all(s == "not-run" for s in statuses[at + 1:])
    return finding


# --- 1. scheduler steps between the micro-batches of a window are no offset ---------------------

def _trace(pattern: str, factors: list[float]):
    """A run from `pattern`: "f" forward (of a micro-batch), "e" forward of other data, "b"
    backward, "s" scheduler.step, "o" optimizer.step.
    The scheduler's i-th step sets the lr to factors[i + 1] (factors[0] before any step)."""
    events, n = [], 0
    for i, c in enumerate(pattern):
        if c == "f":
            events.append(make_event("forward", i, index=i))
        elif c == "e":   # a forward on data that is no micro-batch (an evaluation pass)
            events.append(make_event("forward", i))
        elif c == "b":
            events.append(make_event("backward", i))
        elif c == "o":
            events.append(make_event("step", i, optimizer=0, via_scaler=False))
        else:
            events.append(make_event("scheduler", i, optimizer=0, scheduler_type="LinearLR",
                                     scheduler=1, lr_before=factors[n], lr=factors[n + 1]))
            n += 1
    steps = [SimpleNamespace(group=g, seq=e.seq, optimizer=0)
             for g, e in enumerate(e for e in events if e.kind == "step")]
    return SimpleNamespace(events=events, steps=steps, precision="fp32", error=None,
                           events_of=lambda cls: [e for e in events if isinstance(e, cls)])


#: a warm-up over after 2 scheduler steps, then constant
SHORT_WARMUP = [1 / 3, 2 / 3, 1.0] + [1.0] * 20


def test_a_warmup_over_inside_the_first_window_is_caught_at_step_0():
    """Stepped after every backward (K=4): the first optimizer step runs at the full lr where
    the schedule gives 1/3; no later step differs from the one before, so only the event order
    (scheduler steps between the window's forwards) tells it from an offset."""
    findings = scheduler_findings(None, _trace("fbs" * 4 + "o" + "fbs" * 4 + "o" + "fbs" * 4
                                               + "o", SHORT_WARMUP), "fp32-accum")
    assert [f.kind for f in findings] == ["scheduler-per-microbatch"]
    evidence = findings[0].evidence
    assert evidence["first_step_off"] == 0
    assert evidence["lr_used"] == 1.0 and evidence["lr_expected"] == pytest.approx(1 / 3)
    assert evidence["max_between_optimizer_steps"] == 4 and evidence["measured"] == 4.0


def test_scheduler_steps_before_the_first_forward_are_an_offset():
    """A schedule advanced on purpose before training (resuming at step 5), then stepped once
    per optimizer step: five scheduler steps in the first interval, none a mistake."""
    decay = [0.9 ** i for i in range(20)]
    run = _trace("sssss" + ("fbfbfbfbos" * 3), decay)
    assert scheduler_findings(None, run, "fp32-accum") == []


def test_an_evaluation_forward_before_the_fast_forward_is_not_the_start():
    """A forward on data of its own (a sanity pass), then the schedule advanced to resume, then
    training: the offset is counted up to the first forward of a micro-batch."""
    decay = [0.9 ** i for i in range(20)]
    assert scheduler_findings(None, _trace("e" + "sssss" + ("fbfbfbfbos" * 3), decay),
                              "fp32-accum") == []


def test_one_scheduler_step_per_window_before_its_forwards_is_fine():
    assert scheduler_findings(None, _trace("sfbfbfbfbo" * 3, SHORT_WARMUP), "fp32-accum") == []


def test_a_constant_schedule_between_micro_batches_still_changes_nothing():
    assert scheduler_findings(None, _trace("fbs" * 4 + "o" + "fbs" * 4 + "o", [1.0] * 10),
                              "fp32-accum") == []


@_group("broken_short_warmup_per_microbatch")
def test_short_warmup_stepped_per_micro_batch_fails_fp32_accum(diagnosed):
    """Before: fp32-accum passed (the first step's lr forgiven as an offset) and the skips rung
    blamed the scheduler for stepping on the injected skip instead."""
    finding = _failed_at(diagnosed("broken_short_warmup_per_microbatch"), "fp32-accum",
                         "scheduler-per-microbatch", "broken_short_warmup_per_microbatch.py")
    evidence = finding["evidence"]
    assert evidence["first_step_off"] == 0
    # SGD lr 0.05; LinearLR(start_factor=1/3, total_iters=2) gives 0.05/3 to the first step
    assert evidence["lr_used"] == pytest.approx(0.05)
    assert evidence["lr_expected"] == pytest.approx(0.05 / 3)
    assert evidence["scheduler_steps"] == 12 and evidence["optimizer_steps"] == 3
    assert evidence["measured"] == 4.0 and evidence["max_between_optimizer_steps"] == 4
    assert "optimizer step 0 used lr 0.05 where the schedule gives 0.0166667" in \
        finding["message"]


@pytest.mark.parametrize("name", _configs("healthy_constant_lambdalr_per_microbatch",
                                          "healthy_adamw_clip_sched",
                                          "healthy_scheduler_skip_aware"))
def test_healthy_schedules_stay_clean(name, diagnosed):
    result = diagnosed(name)
    assert result.returncode == 0, result.stderr
    assert result.record["findings"] == [], result.record["findings"]


# --- 2. no / K under a biting clip, with the weighting wrong too ---------------------------------

@_group("broken_missing_average_token_clip")
def test_no_average_with_equal_micro_batch_weights_under_a_biting_clip(diagnosed):
    """Per-micro-batch token means, summed without / K, clipped at 1.0. The norm ratio to the
    (per-token) reference is 6.9, not 4; after the clip 2.6: the K is read against the sum of
    the micro-batch means, and the message says the weighting is off as well."""
    finding = _failed_at(diagnosed("broken_missing_average_token_clip"), "fp32-accum",
                         "missing-accumulation-average", "broken_missing_average_token_clip.py")
    evidence = finding["evidence"]
    assert 3.99 <= evidence["measured"] <= 4.01 and evidence["factor"] == evidence["measured"]
    assert evidence["ratio"] > 5                      # K times a weighting factor
    assert evidence["ratio_after_clip"] < 3.5         # the clip bit
    assert evidence["clip_total_norm"] > 1.0
    assert evidence["weighting_cosine"] < 0.9         # the equal-weight mean is turned
    message = finding["message"]
    assert "not divided by accumulation_steps (K=4)" in message
    assert "The weighting differs as well" in message
    assert "The clip bit (total norm" in message and "not 4x" in message
    assert "count over all K micro-batches" in finding["fix"]


@_group("broken_missing_average_sequence_mean")
def test_no_average_with_per_sequence_means_is_not_a_gradient_mismatch(diagnosed):
    """Per-sequence means (within a micro-batch too the weighting differs), no / K, a biting
    clip: before, `gradient-mismatch` ("matching no known mistake"). The loop's own gradient of
    each micro-batch alone, summed, is its window gradient before the clip."""
    finding = _failed_at(diagnosed("broken_missing_average_sequence_mean"), "fp32-accum",
                         "missing-accumulation-average",
                         "broken_missing_average_sequence_mean.py")
    evidence = finding["evidence"]
    assert 3.99 <= evidence["measured"] <= 4.01
    assert evidence["ratio"] > 5 and evidence["ratio_after_clip"] < 3.5
    assert len(evidence["per_microbatch_ratio"]) == 4
    assert min(evidence["per_microbatch_cosine"]) < 0.99   # off within a micro-batch already
    assert "the loop's own gradient of each micro-batch alone" in finding["message"]
    assert "already within one micro-batch" in finding["message"]
    assert "The weighting differs as well" in finding["message"]


def test_per_sequence_means_divided_by_k_are_not_a_missing_average(tmp_path, records_dir):
    """The same loop with / K: its weighting is still wrong, but it averages over K, so the
    sum of its micro-batch gradients is not what it steps on."""
    project = tmp_path / "project"
    project.mkdir()
    source = (RECIPES / "broken_missing_average_sequence_mean.py").read_text()
    fixed = source.replace("loss = sequence_mean_loss(logits.float(), batch[\"labels\"])",
                           "loss = sequence_mean_loss(logits.float(), batch[\"labels\"]) / K")
    assert fixed != source
    (project / "loop.py").write_text(fixed)
    (project / "common.py").write_text((RECIPES / "common.py").read_text())
    spec = (CONFIGS / "broken_missing_average_sequence_mean.yaml").read_text()
    spec = spec.replace("project_root: ../recipes", "project_root: project")
    spec = spec.replace("broken_missing_average_sequence_mean:train_loop", "loop:train_loop")
    spec = spec.replace("[../recipes/broken_missing_average_sequence_mean.py]", "[project]")
    (tmp_path / "spec.yaml").write_text(spec)
    result = run_cli("diagnose", tmp_path / "spec.yaml", "--json", "--out", records_dir)
    record = result.record
    assert record["failed_rung"] == "fp32-accum", record["rungs"]
    kinds = [f["kind"] for f in record["findings"]]
    assert "missing-accumulation-average" not in kinds, record["findings"]


@pytest.mark.parametrize("name", _configs("broken_missing_average_clip_bites",
                                          "broken_missing_average"))
def test_plain_missing_average_keeps_its_message(name, diagnosed):
    """Equal micro-batches, no weighting: the norm ratio is K and nothing else is said."""
    record = diagnosed(name).record
    finding = record["findings"][0]
    assert finding["kind"] == "missing-accumulation-average"
    assert 3.99 <= finding["evidence"]["ratio"] <= 4.01
    assert "weighting" not in finding["message"] and "weighting_cosine" not in finding["evidence"]


@pytest.mark.parametrize("name", _configs("healthy_token_weighted", "healthy_clip_active",
                                          "healthy_token_weighted_noloss"))
def test_healthy_weighted_and_clipped_loops_stay_clean(name, diagnosed):
    result = diagnosed(name)
    assert result.returncode == 0, result.stderr
    assert [f for f in result.record["findings"] if f["severity"] == "error"] == []


# --- 3. skips after the first real update are an error -------------------------------------------

def _fp16(flags, scales, growth_interval=2000, growth_factor=2.0):
    events = [make_event("scaler_init", 0, enabled=True, growth_interval=growth_interval,
                         growth_factor=growth_factor)]
    for i, (flag, scale) in enumerate(zip(flags, scales, strict=True)):
        events.append(make_event("scaler_step", 2 * i + 1, enabled=True, skipped=flag))
        events.append(make_event("update", 2 * i + 2, scale_before=scale, scale_after=scale))
    return SimpleNamespace(events=events,
                           events_of=lambda cls: [e for e in events if isinstance(e, cls)])


def test_skips_after_the_first_update_are_an_error():
    finding = frequent_skips(_fp16([False, True, True, False, True, False],
                                   [1024.0] * 6), "skips")
    assert finding is not None and finding.severity == "error"
    assert finding.evidence["skipped_after_first_update"] == 3
    assert finding.evidence["steps_after_first_update"] == 5
    assert "drops an update the fp32 reference makes" in finding.message


def test_a_slow_search_alone_stays_a_warning():
    """backoff 0.9 from 2**19: 6 leading skips took the scale down 0.9**6 ~ 0.53, one halving's
    worth (one skip), so 5 are beyond a halving search; then every step goes through."""
    scales = [2.0 ** 19 * 0.9 ** i for i in range(6)] + [2.0 ** 19 * 0.9 ** 6] * 4
    finding = frequent_skips(_fp16([True] * 6 + [False] * 4, scales), "skips")
    assert finding is not None and finding.severity == "warning"
    assert finding.evidence["search_skips_beyond_halvings"] == 5
    assert finding.evidence["skipped_after_first_update"] == 0


def test_a_run_that_never_gets_an_update_through_stays_a_warning():
    finding = frequent_skips(_fp16([True] * 3, [2.0 ** 60, 2.0 ** 59, 2.0 ** 58]), "skips")
    assert finding is not None and finding.severity == "warning"


def test_a_halving_search_then_clean_steps_is_nothing():
    scales = [65536.0, 32768.0, 16384.0] + [8192.0] * 5
    assert frequent_skips(_fp16([True, True, True] + [False] * 5, scales), "skips") is None


def test_one_natural_overflow_is_nothing():
    assert frequent_skips(_fp16([False, True, False], [65536.0, 65536.0, 32768.0]),
                          "skips") is None


@_group("broken_aggressive_growth")
def test_aggressive_growth_fails_the_skips_rung(diagnosed):
    """The first step goes through at 65536; every x16 growth after it overflows and takes
    several halvings to undo: 6 of the 7 later windows are dropped."""
    result = diagnosed("broken_aggressive_growth")
    finding = _failed_at(result, "skips", "frequent-skips", "broken_aggressive_growth.py")
    evidence = finding["evidence"]
    assert evidence["initial_search_skips"] == 0
    assert evidence["skipped_after_first_update"] == 6
    assert evidence["steps_after_first_update"] == 7
    assert evidence["skip_rate_after_first_update"] == pytest.approx(6 / 7, abs=1e-5)
    assert evidence["growth_factor"] == 16.0 and evidence["growth_interval"] == 1
    assert "growth_factor 16 after every good step" in finding["message"]
    assert result.record["series"]["skipped"] == [False, True, True, False, True, True, True,
                                                  True]


@_group("broken_scale_never_settles")
def test_a_scale_still_settling_stays_a_warning(diagnosed):
    result = diagnosed("broken_scale_never_settles")
    assert result.returncode == 0
    finding = next(f for f in result.record["findings"] if f["kind"] == "frequent-skips")
    assert finding["severity"] == "warning"
    assert finding["evidence"]["skipped_after_first_update"] == 0


@pytest.mark.parametrize("name", _configs("healthy_fairseq_overflow_retry",
                                          "healthy_yolo_ema_checkpoint",
                                          "healthy_fairseq_default_scale"))
def test_healthy_overflows_stay_clean(name, diagnosed):
    result = diagnosed(name)
    assert result.returncode == 0, result.stderr
    assert result.record["findings"] == []
