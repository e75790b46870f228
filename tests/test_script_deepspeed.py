"""Script mode on DeepSpeed scripts, end to end through the real CLI and the real DeepSpeed (CPU,
one process): scripts written the way DeepSpeed's guide and DeepSpeedExamples write them
(argparse with `deepspeed.add_config_arguments`, a `--deepspeed_config` file or a config dict
handed to `deepspeed.initialize(config=...)`, `engine.backward(loss)` / `engine.step()` on every
micro-batch). K and the micro-batch come from the engine's config; the reference is the same
script with its engine built at K = 1 and K x b (a copy of a config file in the scratch folder);
healthy ones pass clean at fp32 and bf16, ZeRO 0-3, and fp16 that DeepSpeed refuses on this device
is a skip naming the line, not the user's error. Skipped where DeepSpeed is not installed."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest

from conftest import RECIPES, marked_line, run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (pip install "
                                       "'ampdoctor[deepspeed]')")

SCRIPTS = RECIPES / "scripts"
TRAIN = SCRIPTS / "deepspeed_train.py"              # config dict in code (cifar10_deepspeed's way)
GETTING_STARTED = SCRIPTS / "deepspeed_getting_started.py"   # --deepspeed_config FILE


def _diagnose(tmp_path, script, *args):
    result = run_cli("diagnose", script, "--json", "--out", tmp_path / "runs", "--", *args,
                     cwd=script.parent)
    assert result.stdout.strip(), result.stderr[-3000:]
    return result, json.loads(result.stdout)


def _rung(record, rung_id):
    return next(r for r in record["rungs"] if r["id"] == rung_id)


def _initialize_line(script) -> int:
    return next(i for i, t in enumerate(script.read_text().splitlines(), 1)
                if "= deepspeed.initialize(" in t)


@pytest.mark.parametrize("args", [
    ["--dtype", "fp32"], ["--dtype", "bf16"], ["--stage", "2"],
    ["--stage", "3", "--dtype", "bf16"], ["--clip", "0.05"]],
    ids=["fp32", "bf16", "zero2", "zero3-bf16", "clip"])
def test_healthy_deepspeed_script_passes_clean(tmp_path, args):
    result, record = _diagnose(tmp_path, TRAIN, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert record["findings"] == []
    # K and the micro-batch are the engine's config's; the reference reads the whole window
    assert (record["accumulation_steps"], record["micro_batch_size"]) == (4, 8)
    assert record["found"]["reference_batch"] == 32
    for rung in ("reproducibility", "fp32-accum", "bf16-no-scaler"):
        assert _rung(record, rung)["status"] == "pass", _rung(record, rung)
    assert _rung(record, "fp32-accum")["details"]["steps_compared"] == 3
    bf16 = _rung(record, "bf16-no-scaler")["details"]
    assert bf16["steps_compared"] == 3
    assert 0 < bf16["max_relative_error"] < bf16["tolerance"]
    fp16 = _rung(record, "fp16-scaler")
    if fp16["status"] == "skip":   # a CPU without fp16 kernels: DeepSpeed refuses it
        assert "DeepSpeed refused the fp16" in fp16["summary"]
        facts = fp16["details"]["framework_precision"]
        assert facts["asked_at"].endswith(f"deepspeed_train.py:{_initialize_line(TRAIN)}")
        assert _rung(record, "skips")["status"] == "skip"
    else:
        assert fp16["status"] == "pass", fp16
    assert any("builds a DeepSpeed engine: its config's K = 4 micro-batches of 8" in n
               for n in record["notes"])


def test_config_file_script_passes_and_its_file_is_not_changed(tmp_path):
    config = SCRIPTS / "deepspeed_getting_started.json"
    before = hashlib.sha256(config.read_bytes()).hexdigest()
    result, record = _diagnose(tmp_path, GETTING_STARTED, "--deepspeed_config", config.name)
    assert result.returncode == 0, result.stderr[-3000:]
    assert record["findings"] == []
    assert _rung(record, "fp32-accum")["status"] == "pass"
    assert hashlib.sha256(config.read_bytes()).hexdigest() == before
    # the reference named a scratch copy of the config (K = 1, batch K x b), not the user's file
    reference = record["reference_args"]
    assert reference[0] == "--deepspeed_config" and reference[1] != config.name
    assert reference[1].endswith("k1-batch32-deepspeed_getting_started.json")


def test_loop_dividing_on_top_of_engine_backward_is_double_average(tmp_path):
    """The script reads K from its own config file and divides the loss by it: the engine's
    backward divides again. The reference reads the scratch copy (K = 1), so it does not."""
    result, record = _diagnose(tmp_path, GETTING_STARTED, "--deepspeed_config",
                               "deepspeed_getting_started.json", "--bug", "double-average")
    assert result.returncode == 1, result.stderr[-3000:]
    finding = record["findings"][0]
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "double-average")
    assert finding["evidence"]["measured"] == pytest.approx(0.25, rel=1e-3)
    assert finding["evidence"]["factor"] == pytest.approx(0.25)
    assert finding["evidence"]["framework"] == "DeepSpeed"
    assert finding["location"]["file"].endswith("deepspeed_getting_started.py")
    assert finding["location"]["line"] == marked_line(GETTING_STARTED, "double-average")
    assert "engine.backward(loss)" in finding["message"]


def test_loop_dividing_by_its_own_k_option_is_double_average(tmp_path):
    """The script's K option feeds its config and its loss division: the reference sets the
    option to 1 (and the batch option to K x b) as well as the engine's config, so the reference
    does not divide; the run's engine consumes a quarter of the window's gradient."""
    result, record = _diagnose(tmp_path, TRAIN, "--bug", "double-average")
    assert result.returncode == 1, result.stderr[-3000:]
    reference = record["reference_args"]
    assert reference[reference.index("--gradient_accumulation_steps") + 1] == "1"
    assert reference[reference.index("--per_device_train_batch_size") + 1] == "32"
    finding = record["findings"][0]
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "double-average")
    assert finding["evidence"]["measured"] == pytest.approx(0.25, rel=1e-3)
    assert finding["location"]["line"] == marked_line(TRAIN, "double-average")


def test_a_deepspeed_script_under_a_launcher_of_two_ranks_is_exit_2(tmp_path):
    """Script mode runs a DeepSpeed script in one process: as one of two launched ranks it
    says so and what to use instead, before any run."""
    result = run_cli("diagnose", TRAIN, "--out", tmp_path / "runs", "--",
                     env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "WORLD_SIZE=2" in result.stderr and "wrapper: deepspeed" in result.stderr
    assert "Traceback" not in result.stderr


def test_each_runs_engine_config_is_a_changed_copy_of_the_users():
    """What `deepspeed.initialize` is handed in each run: the rung's precision in the config's
    sections, a reference's K = 1 and K x b at ZeRO stage 0 without clipping, clip-space's
    threshold; the user's mapping itself unchanged."""
    import copy

    from ampdoctor.script.deepspeed import asked_precision, configured
    user = {"train_batch_size": 32, "gradient_accumulation_steps": 4,
            "bfloat16": {"enabled": True}, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "overlap_comm": True}}
    kept = copy.deepcopy(user)
    assert asked_precision(user) == "bf16"
    run = configured(user, "fp32", False, None, None)
    assert (run["bf16"], run["fp16"]) == ({"enabled": False}, {"enabled": False})
    assert asked_precision(run) == "fp32" and "bfloat16" not in run
    assert (run["train_batch_size"], run["gradient_clipping"]) == (32, 1.0)
    assert run["zero_optimization"]["stage"] == 3
    keys = {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 32}
    ref = configured(user, "fp32", True, keys, None)
    assert "train_batch_size" not in ref and "gradient_clipping" not in ref
    assert ref["gradient_accumulation_steps"] == 1
    assert ref["train_micro_batch_size_per_gpu"] == 32
    assert ref["zero_optimization"] == {"stage": 0, "overlap_comm": True}
    given = configured(user, "fp32", True, None, None)   # --reference-args: K as given
    assert (given["train_batch_size"], given["gradient_accumulation_steps"]) == (32, 4)
    clipped = configured(user, "bf16", False, None, 0.5)
    assert clipped["gradient_clipping"] == 0.5 and asked_precision(clipped) == "bf16"
    assert user == kept


@pytest.mark.parametrize(("bug", "kind", "measured"), [
    # the loop steps the engine's WarmupLR on each of the 4 micro-batches, the engine once more
    ("scheduler-twice", "scheduler-per-microbatch", 5.0),
    # engine.zero_grad() sets param.grad = None itself: the line is that call
    ("zero-grad-inside", "zero-grad-inside-accumulation", 1)])
def test_loop_calls_besides_the_engines_are_named_at_their_line(tmp_path, bug, kind, measured):
    result, record = _diagnose(tmp_path, TRAIN, "--bug", bug)
    assert result.returncode == 1, result.stderr[-3000:]
    finding = record["findings"][0]
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", kind)
    assert finding["evidence"]["measured"] == measured
    assert finding["evidence"]["framework"] == "DeepSpeed"
    assert finding["location"]["line"] == marked_line(TRAIN, kind)


def test_gradscaler_over_an_fp16_config_file_is_double_scaling_as_scan_says(tmp_path):
    """The config file the engine was built from is searched with the script: diagnose names
    the GradScaler and the config's fp16 section, the owners `ampdoctor scan SCRIPT CONFIG`
    names, though this device may refuse fp16."""
    script = SCRIPTS / "deepspeed_gradscaler.py"
    config = SCRIPTS / "deepspeed_gradscaler.json"
    result, record = _diagnose(tmp_path, script, "--deepspeed_config", config.name)
    assert result.returncode == 1, result.stderr[-3000:]
    assert record["failed_rung"] == "double-scaling"
    finding = record["findings"][0]
    assert finding["kind"] == "double-scaling" and finding["severity"] == "error"
    assert finding["location"]["line"] == marked_line(script, "double-scaling")
    seen = {(o["kind"], o["file"], o["line"]) for o in finding["evidence"]["owners"]}
    assert ("DeepSpeed fp16", str(config), 5) in seen
    scan = run_cli("scan", str(script), str(config), "--json")
    assert scan.returncode == 1
    assert {(o["kind"], o["file"], o["line"]) for o in json.loads(scan.stdout)["owners"]} == seen


@pytest.mark.parametrize("bug", ["none", "missing-average"])
def test_loop_accumulating_around_an_engine_of_k_1_takes_k_from_the_loop(tmp_path, bug):
    """The config's gradient_accumulation_steps is 1 and the loop steps the engine every K
    micro-batches itself: K is the loop's (4), and its --accum option is 1 in the reference.
    Dividing by K itself is healthy; without the division (the engine does not divide at K 1)
    the update is the sum of the micro-batch gradients, 4x."""
    script = GETTING_STARTED
    result, record = _diagnose(tmp_path, script, "--deepspeed_config",
                               "deepspeed_loop_accumulation.json", "--accum", "4", "--bug", bug)
    assert record["accumulation_steps"] == 4
    reference = record["reference_args"]
    assert reference[reference.index("--accum") + 1] == "1"
    if bug == "none":
        assert result.returncode == 0, result.stderr[-3000:]
        assert record["findings"] == []
        assert _rung(record, "fp32-accum")["details"]["steps_compared"] == 3
        return
    assert result.returncode == 1, result.stderr[-3000:]
    finding = record["findings"][0]
    assert (finding["rung"], finding["kind"]) == ("fp32-accum", "missing-accumulation-average")
    assert finding["evidence"]["measured"] == pytest.approx(4.0, rel=1e-3)
    assert finding["location"]["line"] == marked_line(script, "missing-accumulation-average")
