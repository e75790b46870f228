"""End-to-end with the real DeepSpeed (CPU): loops written the way DeepSpeed's guide writes them
(`deepspeed.initialize`, `engine.backward(loss)`, `engine.step()` on every micro-batch), one
process, fp32 and bf16, ZeRO stages 0-3. Healthy ones pass clean: the consumed gradient is read
where the engine's optimizer consumes it (fp32 masters, flat partitions, ZeRO-3 shards put back
together), the bf16 module cast over fp32 masters is not a half-open AMP, and fp16 that DeepSpeed
refuses on the device is a skip naming the line that asked. Each bug is named with its kind,
number and line. Skipped, with the reason, where DeepSpeed is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import CONFIGS, RECIPES, marked_line, run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (pip install "
                                       "'ampdoctor[deepspeed]')")

LOOPS = RECIPES / "deepspeed_loops.py"


def _rung(record, rung_id):
    return next(r for r in record["rungs"] if r["id"] == rung_id)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_healthy_deepspeed_loop_passes_every_zero_stage(stage, diagnosed):
    result = diagnosed(f"deepspeed_healthy_zero{stage}")
    record = result.record
    assert result.returncode == 0, result.result.stdout[-3000:]
    assert record["findings"] == []
    for rung in ("reproducibility", "fp32-accum", "bf16-no-scaler"):
        assert _rung(record, rung)["status"] == "pass", _rung(record, rung)
    # every optimizer step of both precisions was compared with the reference
    assert _rung(record, "fp32-accum")["details"]["steps_compared"] == 3
    bf16 = _rung(record, "bf16-no-scaler")["details"]
    assert bf16["steps_compared"] == 3
    assert 0 < bf16["max_relative_error"] < bf16["tolerance"]
    fp16 = _rung(record, "fp16-scaler")
    if fp16["status"] == "skip":   # a CPU without fp16 kernels: DeepSpeed refuses it
        facts = fp16["details"]["framework_precision"]
        assert facts["framework"] == "DeepSpeed" and facts["precision_ran"] is None
        assert "DeepSpeed refused the fp16" in fp16["summary"]
        assert "not supported on your device" in fp16["summary"]
        assert facts["asked_at"].endswith(f"deepspeed_loops.py:{_initialize_line()}")
    else:
        assert fp16["status"] == "pass", fp16


def _initialize_line() -> int:
    lines = LOOPS.read_text().splitlines()
    start = next(i for i, t in enumerate(lines, 1) if t.startswith("def _train("))
    return next(i for i, t in enumerate(lines, 1) if i > start and "deepspeed.initialize(" in t)


# broken config -> (kind, measured band)
BROKEN = {
    # engine.backward divides by gradient_accumulation_steps itself: the loop's / K is a second
    "deepspeed_broken_double_average": ("double-average", (0.249, 0.251)),
    # DeepSpeed sets param.grad = None itself: the line is the engine.zero_grad() call
    "deepspeed_broken_zero_grad_inside": ("zero-grad-inside-accumulation", (1, 1)),
    # the engine steps at its own boundary (2) under a loop that feeds K = 4: the config key
    "deepspeed_broken_config_accumulation_mismatch": ("step-per-microbatch", (6, 6)),
    # the engine steps its WarmupLR once per step, the loop once per micro-batch: 5x
    "deepspeed_broken_scheduler_twice": ("scheduler-per-microbatch", (5, 5)),
    # optimizer.step() on every micro-batch besides engine.step(): 4 + 1 per window
    "deepspeed_broken_optimizer_step_besides": ("step-per-microbatch", (15, 15)),
}

#: which `# BUG: kind` marker of the recipe a config's finding points at (the n-th)
MARKER = {"deepspeed_broken_optimizer_step_besides": 1}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_deepspeed_bug_is_named_with_its_number_and_line(name, diagnosed):
    result = diagnosed(name)
    assert result.returncode == 1, result.result.stdout[-3000:]
    kind, (low, high) = BROKEN[name]
    finding = result.record["findings"][0]
    assert finding["kind"] == kind and finding["severity"] == "error"
    assert low <= finding["evidence"]["measured"] <= high, finding["evidence"]
    assert finding["location"]["file"].endswith("deepspeed_loops.py")
    assert finding["location"]["line"] == _marked(kind, MARKER.get(name, 0))


def _marked(kind: str, nth: int) -> int:
    lines = [i for i, t in enumerate(LOOPS.read_text().splitlines(), 1) if f"# BUG: {kind}" in t]
    assert lines[0] == marked_line(LOOPS, kind)
    return lines[nth]


def test_config_mismatch_names_the_config_key_and_its_value(diagnosed):
    finding = diagnosed("deepspeed_broken_config_accumulation_mismatch").record["findings"][0]
    assert finding["evidence"]["config_gradient_accumulation_steps"] == 2
    assert "gradient_accumulation_steps = 2 while the loop feeds K = 4" in finding["message"]


def test_loop_scheduler_besides_the_engines_says_the_engine_steps_it(diagnosed):
    finding = diagnosed("deepspeed_broken_scheduler_twice").record["findings"][0]
    assert "engine.step() already steps the engine's WarmupLR" in finding["message"]


def test_zero_grad_inside_tells_the_engine_clears_the_gradients_itself(diagnosed):
    finding = diagnosed("deepspeed_broken_zero_grad_inside").record["findings"][0]
    assert "Remove the loop's engine.zero_grad(): engine.step() clears" in finding["fix"]


def test_deepspeed_patches_are_installed_and_undone_exactly():
    """The engine's methods, DeepSpeed's schedules and its init_distributed are patched while a
    run records and are the original objects again after (a diagnose runs in a worker process;
    this is the undo that process relies on)."""
    import deepspeed.comm
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.lr_schedules import WarmupLR

    from ampdoctor.probe import deepspeed as deepspeed_probe
    from ampdoctor.probe.patches import Patcher

    names = ("__init__", "_take_model_step", "zero_grad")
    before = {name: vars(DeepSpeedEngine)[name] for name in names}
    step, init = vars(WarmupLR)["step"], deepspeed.comm.init_distributed
    patcher = Patcher()
    deepspeed_probe.install(patcher)
    try:
        assert all(vars(DeepSpeedEngine)[name] is not before[name] for name in names)
        assert vars(WarmupLR)["step"] is not step
        assert deepspeed.comm.init_distributed is not init
    finally:
        patcher.undo()
    assert {name: vars(DeepSpeedEngine)[name] for name in names} == before
    assert vars(WarmupLR)["step"] is step
    assert deepspeed.comm.init_distributed is init


def test_double_average_names_the_engine_as_the_first_division(diagnosed):
    finding = diagnosed("deepspeed_broken_double_average").record["findings"][0]
    assert finding["evidence"]["framework"] == "DeepSpeed"
    assert "engine.backward(loss)` already divides" in finding["message"]


def test_gradscaler_over_a_deepspeed_fp16_config_is_double_scaling_in_scan_and_diagnose(diagnosed):
    """The config file's fp16 section and the loop's GradScaler: two loss-scale owners, found
    by `diagnose` (its double-scaling rung, though this device may refuse fp16) and by `scan`
    of the same files, at the same lines."""
    result = diagnosed("deepspeed_broken_gradscaler_over_fp16_config")
    assert result.returncode == 1
    record = result.record
    assert record["failed_rung"] == "double-scaling"
    finding = record["findings"][0]
    assert finding["kind"] == "double-scaling" and finding["severity"] == "error"
    script = RECIPES / "deepspeed_gradscaler.py"
    assert finding["location"]["line"] == marked_line(script, "double-scaling")
    seen = {(o["kind"], o["file"], o["line"]) for o in finding["evidence"]["owners"]}
    scan = run_cli("scan", str(script), str(RECIPES / "deepspeed_fp16.json"), "--json")
    assert scan.returncode == 1
    assert {(o["kind"], o["file"], o["line"]) for o in scan.record["owners"]} == seen
    assert ("DeepSpeed fp16", str(RECIPES / "deepspeed_fp16.json"), 5) in seen


# ------------------------------------------------------------------ the `deepspeed:` entry point
def test_deepspeed_key_builds_each_rungs_engine_from_the_users_config(diagnosed):
    """No train_loop: the engine of every rung from the config (ZeRO-2, its own AdamW and
    WarmupLR, bf16 section) with the spec's K, micro-batch, precision and a biting clip."""
    result = diagnosed("deepspeed_healthy_key")
    assert result.returncode == 0, result.result.stdout[-3000:]
    record = result.record
    assert record["findings"] == []
    assert _rung(record, "fp32-accum")["details"]["steps_compared"] == 3
    assert _rung(record, "bf16-no-scaler")["details"]["steps_compared"] == 3
    # DeepSpeed refuses fp16 without CUDA ("Type fp16 is not supported on your device"): the
    # rung skips there and compares on a GPU
    fp16 = _rung(record, "fp16-scaler")
    assert fp16["status"] == ("pass" if record["cuda_available"] else "skip"), fp16["summary"]


def _spec(tmp_path, config, **extra):
    import yaml

    spec = {"project_root": str(RECIPES), "model": "common:make_mlp",
            "data": "common:make_regression_data", "loss": "common:mse_loss",
            "deepspeed": {"config": config}, "accumulation_steps": 4, "micro_batch_size": 8,
            "optimizer_steps": 1, "device": "cpu", "rungs": ["fp32-accum"], **extra}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize(("config", "says"), [
    ({"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 0}},
     "sets gradient_accumulation_steps = 8 but the spec's accumulation_steps is 4"),
    ("missing.json", "'deepspeed.config': cannot read"),
])
def test_deepspeed_key_with_a_config_that_cannot_be_used_is_a_spec_error(config, says, tmp_path):
    result = run_cli("diagnose", str(_spec(tmp_path, config)), "--out", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert says in result.stdout + result.stderr


def test_deepspeed_key_needs_a_loss(tmp_path):
    path = _spec(tmp_path, {"zero_optimization": {"stage": 0}})
    path.write_text(path.read_text().replace("loss: common:mse_loss\n", ""))
    result = run_cli("diagnose", str(path), "--out", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert "spec key 'loss' is missing: with 'deepspeed'" in result.stdout + result.stderr


# ------------------------------------------------------------------ two ranks, the engine talking
@pytest.mark.parametrize("name", ["deepspeed_healthy_ddp_zero0", "deepspeed_healthy_ddp_zero2",
                                  "deepspeed_healthy_ddp_zero3", "deepspeed_healthy_key_ddp"])
def test_two_ranks_with_the_engine_doing_the_communication_pass_clean(name, tmp_path):
    """`ddp: {wrapper: deepspeed}`: the loop's engine reduces (no DDP of ampdoctor's around
    it); every rank's consumed gradient -- ZeRO shards of both ranks put together -- is the
    reference gradient of the global batch, and the ranks agree. The `deepspeed` key too."""
    config = CONFIGS / f"{name}.yaml"
    result = run_cli("diagnose", str(config), "--rungs", "ddp-sync", "--json",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rung = _rung(result.record, "ddp-sync")
    assert rung["status"] == "pass", rung
    assert "DeepSpeed's engine did the communication over 2 ranks" in rung["summary"]
    assert rung["details"]["gradient_difference_between_ranks"] == [0.0, 0.0, 0.0]
    assert rung["details"]["optimizer_steps"] == 3


def test_loss_divided_by_world_size_under_the_engine_is_double_average(diagnosed):
    result = diagnosed("deepspeed_broken_ddp_loss_over_world_size")
    assert result.returncode == 1
    record = result.record
    assert record["failed_rung"] == "ddp-sync"
    finding = record["findings"][0]
    assert finding["kind"] == "double-average"
    assert 0.499 <= finding["evidence"]["measured"] <= 0.501
    assert finding["location"]["line"] == _marked("double-average", 1)
    assert "DeepSpeed already averages gradients over the ranks" in finding["message"]


def test_our_ddp_around_a_deepspeed_loop_is_a_skip_that_names_the_wrapper_to_use(tmp_path):
    """ampdoctor's DDP around a model the loop hands to DeepSpeed would add all-reduces of its
    own to the engine's: the rung says to use `wrapper: deepspeed`, judging nothing it did not
    measure (it used to report missing-no-sync on a healthy loop)."""
    import yaml

    spec = yaml.safe_load((CONFIGS / "deepspeed_healthy_ddp_zero0.yaml").read_text())
    spec.update(project_root=str(RECIPES), scan={"paths": [str(LOOPS)]},
                ddp={"world_size": 2, "wrapper": "ddp", "timeout_s": 240})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = run_cli("diagnose", str(path), "--rungs", "ddp-sync", "--json",
                     "--out", str(tmp_path / "runs"))
    rung = _rung(result.record, "ddp-sync")
    assert rung["status"] == "skip", rung
    assert "set `ddp: {wrapper: deepspeed}`" in rung["summary"]
    assert result.record["findings"] == []
