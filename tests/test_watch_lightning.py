"""`ampdoctor.sentinel.lightning.WatchCallback`: the sentinel as a Lightning callback, with the
real installed `lightning` Trainer on CPU (issue 37, part 2).

The module is `recipes/watch/lightning_module.py`; each bug is planted by an argument and marked
`# BUG: <kind>` on its line. Every check runs a real `Trainer.fit`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import ampdoctor
from ampdoctor.ddp.launch import free_port
from conftest import RECIPES, marked_line

MODULE = RECIPES / "watch" / "lightning_module.py"
sys.path.insert(0, str(MODULE.parent))
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning_module import MAX_NORM, train  # noqa: E402


def _fit(bug="none", precision="32-true", **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(bug, precision, **kwargs)


def _found(cb):
    return {f["kind"]: f for f in cb.record["findings"]}


@pytest.mark.parametrize(("precision", "clip"), [("32-true", None), ("bf16-mixed", 0.05),
                                                 ("32-true", 0.05)])
def test_the_training_is_bit_identical_with_the_callback(precision, clip):
    """12 optimizer steps of 4 micro-batches, dropout on, a check every 2 steps: the weights and
    the random state end as they end without the callback."""
    watched, cb, _ = _fit("none", precision, clip=clip, every=2)
    rng_watched = torch.get_rng_state()
    plain, _, _ = _fit("none", precision, clip=clip, watched=False)
    for (name, a), b in zip(watched.state_dict().items(), plain.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(rng_watched, torch.get_rng_state())
    assert len(cb.record["watch"]["checked"]) >= 5
    assert cb.record["verdict"] == "healthy"


@pytest.mark.parametrize(("precision", "clip"), [("32-true", None), ("32-true", 0.05),
                                                 ("bf16-mixed", None), ("bf16-mixed", 0.05)])
def test_a_healthy_module_is_silent(precision, clip):
    _, cb, trainer = _fit("none", precision, clip=clip)
    assert cb.record["verdict"] == "healthy" and cb.record["findings"] == []
    checked = cb.record["watch"]["checked"]
    assert checked and all(c["ok"] for c in checked) and checked[0]["step"] == 1
    assert checked[0]["precision"] == {"32-true": "fp32", "bf16-mixed": "bf16"}[precision]
    assert cb.record["accumulation_steps"] == trainer.accumulate_grad_batches == 4
    assert cb.record["optimizer_steps"] == trainer.global_step == 12


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_healthy_manual_optimization_module_is_silent(precision):
    _, cb, _ = _fit("manual", precision)
    assert cb.record["verdict"] == "healthy" and cb.record["findings"] == []
    assert cb.record["watch"]["checked"] and all(c["ok"] for c in cb.record["watch"]["checked"])


@pytest.mark.parametrize(("precision", "clip"), [("32-true", None), ("bf16-mixed", 0.05)])
def test_a_training_step_that_divides_by_k_itself_is_a_double_average(precision, clip):
    _, cb, _ = _fit("double-average", precision, clip=clip)
    found = _found(cb)
    assert list(found) == ["double-average"] and cb.record["verdict"] == "failed"
    finding = found["double-average"]
    assert finding["severity"] == "error" and finding["rung"] == "watch"
    assert finding["evidence"]["measured"] == pytest.approx(0.25, rel=0.02)
    assert finding["evidence"]["factor"] == 0.25
    assert finding["location"]["line"] == marked_line(MODULE, "double-average")
    assert finding["location"]["file"].endswith("lightning_module.py")


#: bug -> (kind, evidence that must hold): manual optimization's first, then automatic's
BROKEN = {
    "step-per-microbatch": ("step-per-microbatch",
                            {"backwards_per_step": [1, 1, 1], "expected": 4}),
    # zero_grad at every micro-batch: the last zero_grad leaves the last micro-batch's gradient
    "zero-grad-inside-accumulation": ("zero-grad-inside-accumulation",
                                      {"measured": 1, "expected": 4}),
    "missing-accumulation-average": ("missing-accumulation-average",
                                     {"measured": 4.0, "factor": 4}),
    # automatic optimization: zero_grad from training_step (the replay's call does nothing)
    "zero-grad-in-training-step": ("zero-grad-inside-accumulation",
                                   {"measured": 1, "expected": 4}),
    # the module's own scheduler step besides Lightning's, once per optimizer step
    "scheduler-per-microbatch": ("scheduler-per-microbatch", {"measured": 5, "expected": 1}),
}


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_each_bug_is_named_at_its_line_and_the_training_is_unchanged(bug):
    watched, cb, _ = _fit(bug)
    kind, evidence = BROKEN[bug]
    found = _found(cb)
    assert list(found) == [kind], found
    finding = found[kind]
    assert finding["severity"] == "error"
    assert finding["location"]["line"] == marked_line(MODULE, kind)
    for key, value in evidence.items():
        assert finding["evidence"][key] == pytest.approx(value), (key, finding["evidence"])
    # the replayed training_step's own zero_grad / scheduler step touch nothing of the run
    plain, _, _ = _fit(bug, watched=False)
    for a, b in zip(watched.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ fp16 with a GradScaler on CPU
class _Steps(Callback):
    """What the run did at each optimizer step, read from Lightning and torch, not from the
    sentinel: Adam's step count before it (a skipped step leaves it), the scale, and the norm
    of the gradient the optimizer is about to consume (Lightning calls this after unscale_)."""

    def __init__(self):
        self.adam, self.scale, self.norm = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.adam.append(_adam_steps(optimizer))
        self.scale.append(trainer.precision_plugin.scaler.get_scale())
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norm.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))))


def _adam_steps(optimizer):
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    return int(state["step"]) if "step" in state else 0


def test_16_mixed_on_cpu_runs_fp16_with_the_user_s_grad_scaler():
    """The recipe's explicit plugin: the forward autocasts to float16 and the callback watches
    the GradScaler built on the recipe's line."""
    _, cb, trainer = _fit("none", "16-mixed", steps=2)
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert str(trainer.precision) == "16-mixed"
    with trainer.precision_plugin.forward_context():
        assert trainer.lightning_module.net(torch.randn(2, 16)).dtype == torch.float16
    assert cb.record["watch"]["checked"][0]["precision"] == "fp16"


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_healthy_fp16_module_is_silent_and_bit_identical(clip):
    watched, cb, trainer = _fit("none", "16-mixed", clip=clip, every=2)
    rng_watched = torch.get_rng_state()
    plain, _, _ = _fit("none", "16-mixed", clip=clip, watched=False)
    for (name, a), b in zip(watched.state_dict().items(), plain.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(rng_watched, torch.get_rng_state())
    assert cb.record["verdict"] == "healthy" and cb.record["findings"] == []
    checked = cb.record["watch"]["checked"]
    assert len(checked) >= 5 and all(c["ok"] and c["precision"] == "fp16" for c in checked)
    assert cb.record["watch"]["skipped_steps"] == 0 and trainer.global_step == 12


def test_a_scaler_that_keeps_growing_into_overflow_is_frequent_skips():
    """GradScaler(growth_interval=1): the scale doubles after every finite step until the fp16
    gradients overflow, then every other step is skipped. The rate is counted from Adam's own
    step count at each of Lightning's optimizer steps."""
    steps = _Steps()
    watched, cb, trainer = _fit("frequent-skips", "16-mixed", extra=[steps])
    adam = steps.adam + [_adam_steps(trainer.optimizers[0])]
    skipped = [i for i in range(len(steps.adam)) if adam[i + 1] == adam[i]]
    first_real = next(i for i in range(len(steps.adam)) if adam[i + 1] > adam[i])
    steady = [i for i in skipped if i > first_real]
    rate = len(steady) / (len(steps.adam) - first_real - 1)
    assert len(steps.adam) == trainer.global_step == 12 and rate > 0.25
    found = _found(cb)
    finding = found["frequent-skips"]
    assert finding["severity"] == "error"
    assert finding["location"]["line"] == marked_line(MODULE, "frequent-skips")
    assert finding["evidence"]["measured"] == pytest.approx(rate, abs=1e-6)
    assert finding["evidence"]["skipped"] == len(steady)
    assert finding["evidence"]["growth_interval"] == 1
    assert finding["evidence"]["scale"] == trainer.precision_plugin.scaler.get_scale()
    # Lightning steps the LR scheduler after every optimizer step, skipped or not: the
    # schedule runs ahead of the real updates by the skips
    on_skip = found.pop("scheduler-steps-on-skip")
    assert on_skip["evidence"]["steady_skips"] == len(steady)
    assert on_skip["evidence"]["optimizer_steps"] == adam[-1]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == trainer.global_step > adam[-1]
    assert list(found) == ["frequent-skips"]
    plain, _, _ = _fit("frequent-skips", "16-mixed", watched=False)
    for a, b in zip(watched.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_clip_between_manual_backward_and_step_clips_scaled_gradients():
    """Manual optimization: Lightning unscales inside `opt.step()`, so a clip_grad_norm_ before
    it sees the loss scale times the true norm and clips in scaled space. Its healthy twin clips
    in `on_before_optimizer_step`, after the unscale_: silent, and the true norm it clips is the
    one the finding gives."""
    broken_steps, twin_steps = _Steps(), _Steps()
    watched, cb, trainer = _fit("clip-before-unscale", "16-mixed", extra=[broken_steps])
    _, twin, _ = _fit("manual-clip", "16-mixed", extra=[twin_steps])
    assert twin.record["verdict"] == "healthy" and twin.record["findings"] == []
    assert twin.record["watch"]["checked"] and all(c["ok"] for c in twin.record["watch"]["checked"])
    (finding,) = cb.record["findings"]
    assert finding["kind"] == "clip-before-unscale" and finding["severity"] == "error"
    assert finding["location"]["line"] == marked_line(MODULE, "clip-before-unscale")
    evidence = finding["evidence"]
    scale = broken_steps.scale[0]
    assert evidence["step"] == 0 and evidence["scale"] == scale == 2.0 ** 16
    assert evidence["measured"] == pytest.approx(scale)
    # the same first window, unclipped and unscaled, in the twin (callbacks run before the
    # module's hook that clips)
    assert evidence["true_norm"] == pytest.approx(twin_steps.norm[0], rel=1e-5)
    assert evidence["norm_seen_by_clip"] == pytest.approx(scale * twin_steps.norm[0], rel=1e-5)
    # what the optimizer consumed: clipped to MAX_NORM in scaled space, then unscaled
    assert broken_steps.norm[0] == pytest.approx(MAX_NORM / scale, rel=1e-3)
    assert all(c.get("explained_by") == "clip-before-unscale"
               for c in cb.record["watch"]["checked"])
    plain, _, _ = _fit("clip-before-unscale", "16-mixed", watched=False)
    for a, b in zip(watched.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _line_with(text):
    return next(n for n, line in enumerate(MODULE.read_text().splitlines(), start=1)
                if text in line)


def test_a_clip_in_on_after_backward_clips_scaled_gradients():
    """Automatic optimization: Lightning calls `on_after_backward` after each micro-batch's
    backward, before its unscale_, so a clip there clips in scaled space (`gradient_clip_val`,
    the healthy way, is silent above)."""
    steps = _Steps()
    _, cb, _ = _fit("clip-in-on-after-backward", "16-mixed", extra=[steps])
    (finding,) = cb.record["findings"]
    assert finding["kind"] == "clip-before-unscale" and finding["severity"] == "error"
    assert finding["location"]["line"] == _line_with("# clip on scaled grads")
    scale = steps.scale[0]
    assert finding["evidence"]["scale"] == scale and finding["evidence"]["measured"] == scale
    assert finding["evidence"]["norm_seen_by_clip"] > MAX_NORM
    # the last micro-batch's clip bit in scaled space: the step consumed MAX_NORM / scale
    assert steps.norm[0] == pytest.approx(MAX_NORM / scale, rel=1e-3)


def test_lightning_s_documented_manual_clip_sees_scaled_gradients_too():
    """`self.clip_gradients(opt, ...)` between `manual_backward` and `opt.step()`, as
    Lightning's manual-optimization docs show it: under 16-mixed, Lightning's own clip sees the
    same scaled gradients (its `MixedPrecision.clip_gradients` does not unscale; Lightning
    issue 18089). The update is the scaled-space one, so the sentinel reports it, at that line,
    with the same numbers as the user's own clip_grad_norm_ there."""
    _, docs, _ = _fit("manual-clip-gradients", "16-mixed")
    _, own, _ = _fit("clip-before-unscale", "16-mixed")
    (finding,) = docs.record["findings"]
    assert finding["kind"] == "clip-before-unscale"
    assert finding["location"]["line"] == _line_with("self.clip_gradients(opt,")
    mine = own.record["findings"][0]["evidence"]
    for key in ("scale", "norm_seen_by_clip", "true_norm", "measured"):
        assert finding["evidence"][key] == mine[key], key
    # the fix in Lightning's terms: where to clip instead, and that its own call is the issue
    assert finding["evidence"]["framework"] == "Lightning"
    assert "on_before_optimizer_step" in finding["fix"] and "#18089" in finding["fix"]


def test_on_error_raise_stops_fit_with_the_finding():
    with pytest.raises(ampdoctor.WatchError, match="double-average") as info:
        _fit("double-average", on_error="raise")
    assert info.value.finding.location.line == marked_line(MODULE, "double-average")


def test_on_error_stop_ends_the_fit_cleanly(tmp_path):
    _, cb, trainer = _fit("double-average", on_error="stop", out=tmp_path)
    assert trainer.should_stop and trainer.global_step == 2     # stopped after the checked step
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["verdict"] == "failed" and saved["findings"][0]["kind"] == "double-average"


def test_findings_go_to_the_logger_and_as_a_lightning_warning(tmp_path):
    from lightning.pytorch.loggers import CSVLogger
    logger = CSVLogger(tmp_path, name="run")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train("double-average", logger=logger)
    texts = [str(w.message) for w in said if "ampdoctor watch" in str(w.message)]
    assert texts and "double-average" in texts[0] and "lightning_module.py:" in texts[0]
    header = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()[0]
    assert "ampdoctor/double-average" in header.split(",")


def test_what_it_cannot_watch_is_refused_plainly():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ampdoctor.sentinel.lightning import WatchCallback

    class TwoOptimizers(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return [torch.optim.SGD(self.a.parameters(), lr=0.1),
                    torch.optim.SGD(self.b.parameters(), lr=0.1)]

    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[
        WatchCallback(accumulation_steps=2)], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="one optimizer; configure_optimizers gave 2"):
        trainer.fit(TwoOptimizers(), loader)
    with pytest.raises(ValueError, match="manual optimization.*accumulation_steps=K"):
        train("manual", accumulation_steps=None)
    with pytest.raises(ValueError, match="on_error"):
        WatchCallback(on_error="panic")


def test_importing_ampdoctor_does_not_import_lightning():
    code = ("import sys, ampdoctor; ampdoctor.watch; "
            "print('lightning' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["none", "double-average"])
def test_under_the_ddp_strategy_each_rank_checks_and_rank_0_writes_one_record(bug, tmp_path):
    """`Trainer(strategy="ddp", devices=2)` under torchrun, 2 gloo ranks on CPU, each on its
    DistributedSampler shard: the reference is the mean of the ranks' replays."""
    import os
    out, result = tmp_path / "out", tmp_path / "result"
    out.mkdir()
    result.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(MODULE),
         bug, str(out), str(result)], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(out.glob("*.json"))) == 1
    for rank in (0, 1):
        held = json.loads((result / f"rank{rank}.json").read_text())
        record = held["record"]
        assert held["identical"] and record["watch"]["world_size"] == 2
        ratios = [c["ratio"] for c in record["watch"]["checked"]]
        expected = 1.0 if bug == "none" else 0.25
        assert len(ratios) == 3 and all(r == pytest.approx(expected, rel=1e-4) for r in ratios)
        kinds = [f["kind"] for f in record["findings"]]
        assert kinds == ([] if bug == "none" else ["double-average"])
        if kinds:
            assert record["findings"][0]["evidence"]["rank"] == [0, 1]
            assert record["findings"][0]["location"]["line"] == marked_line(MODULE, bug)


# ------------------------------------------------------------------------------ Fabric
FABRIC = RECIPES / "watch" / "fabric_loop.py"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_fabric_loop_watched_as_it_is_set_up(precision):
    """`ampdoctor.watch(model, optimizer, ...)` with the objects `fabric.setup` returned: the
    module and optimizer inside are hooked and replayed (Fabric's forward would autocast the
    replay); silent and bit-identical when healthy, a missing ÷K named at its line."""
    from fabric_loop import train as fabric_train
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watched, watch = fabric_train("none", precision)
        plain, _ = fabric_train("none", precision, watched=False)
        _, broken = fabric_train("missing-accumulation-average", precision)
    for a, b in zip(watched.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert watch.record["verdict"] == "healthy" and len(watch.checked) == 3
    assert {c["precision"] for c in watch.checked} == {"32-true": {"fp32"},
                                                      "bf16-mixed": {"bf16"}}[precision]
    (finding,) = broken.findings
    assert finding.kind == "missing-accumulation-average"
    assert finding.evidence["measured"] == pytest.approx(4.0, rel=0.01)
    assert finding.location.line == marked_line(FABRIC, "missing-accumulation-average")
