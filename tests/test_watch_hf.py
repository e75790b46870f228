"""`ampdoctor.sentinel.hf.WatchCallback` inside the real HF Trainer (transformers installed, a
tiny GPT-2 built from a config, CPU; nothing mocked, nothing downloaded).

The run is `recipes/watch/hf_trainer.py`; its bugs are marked `# BUG: <kind>` on their line.
The oracle is read off the data and the Trainer itself: each micro-batch's real tokens, and
the Trainer's own `num_items_in_batch` count.
"""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import ampdoctor
from conftest import RECIPES, marked_line

LOOP = RECIPES / "watch" / "hf_trainer.py"
sys.path.insert(0, str(LOOP.parent))
from hf_trainer import IGNORE, rows, train  # noqa: E402

K, B = 4, 2


def _run(bug: str, precision: str = "fp32", **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(bug, precision, K=K, b=B, **kwargs)


def _window_rows(window: int) -> list[list[dict]]:
    data = rows(8 * K * B)
    start = window * K * B
    return [data[start + i * B:start + (i + 1) * B] for i in range(K)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.05])
def test_a_healthy_trainer_run_is_silent(precision, max_grad_norm):
    _, callback = _run("none", precision, steps=4, every=1, max_grad_norm=max_grad_norm)
    record = callback.record
    assert record["verdict"] == "healthy" and record["findings"] == []
    checked = callback.watch.checked
    assert [c["step"] for c in checked] == [1, 2, 3] and all(c["ok"] for c in checked)
    assert all(c["precision"] == precision for c in checked)
    # token-weighted: each micro-batch counted as the Trainer counts num_items_in_batch
    # (this transformers counts every real label; its GPT-2 loss predicts all but the first)
    counted = [sum(int(r["labels"].ne(IGNORE).sum()) for r in micro) for micro in _window_rows(1)]
    assert checked[0]["counts"] == counted and len(set(counted)) > 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_healthy_loss_that_is_no_plain_cross_entropy_is_silent(precision):
    """A z-loss added to the token cross-entropy, divided by num_items_in_batch: the watch
    replays the model's summed loss over the Trainer's count, on ragged tokens."""
    _, callback = _run("z-loss", precision, steps=4, every=1)
    assert callback.record["findings"] == []
    checked = callback.watch.checked
    assert len(checked) == 3 and all(c["ok"] for c in checked)
    assert len(set(checked[0]["counts"])) > 1


def test_the_counts_are_the_trainer_s_own_num_items_in_batch():
    """The oracle is the Trainer's own count, asked of a Trainer on the same model."""
    import tempfile

    from hf_trainer import build_model
    from transformers import Trainer, TrainingArguments
    from transformers.data.data_collator import default_data_collator
    _, callback = _run("none", steps=2)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model=build_model(), args=TrainingArguments(
            output_dir=out, use_cpu=True, report_to="none"))
        expected = [int(trainer._get_num_items_in_batch([default_data_collator(micro)],
                                                        torch.device("cpu")))
                    for micro in _window_rows(1)]
    assert callback.watch.checked[0]["counts"] == expected


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_is_bit_identical_with_the_callback(precision):
    """50 optimizer steps (dropout on, a clip, ragged tokens, a replay every 5 steps): the
    weights and the random state end as they end without the callback."""
    torch.manual_seed(0)
    watched, callback = _run("none", precision, steps=50, every=5)
    rng_watched = torch.get_rng_state()
    torch.manual_seed(0)
    plain, _ = _run("none", precision, steps=50, watched=False)
    for (name, a), b in zip(watched.state_dict().items(), plain.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(rng_watched, torch.get_rng_state())
    assert len(callback.watch.checked) == 10          # window 1, then every 5th
    assert callback.record["verdict"] == "healthy"


@pytest.mark.parametrize("bug", ["zero-grad-inside-accumulation", "scheduler-per-microbatch"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_classic_bug_in_a_trainer_override_is_named_at_its_line(bug, precision):
    _, callback = _run(bug, precision, steps=4)
    found = {f.kind: f for f in callback.findings}
    assert set(found) == {bug}, found
    assert found[bug].severity == "error"
    assert found[bug].location.line == marked_line(LOOP, bug)


def test_the_trainer_saves_checkpoints_while_watched():
    """A checkpoint pickles the scheduler's state (its `__dict__`): nothing of the watch may be
    in it."""
    watched, callback = _run("none", steps=4, save_steps=2, every=1)
    plain, _ = _run("none", steps=4, save_steps=2, watched=False)
    assert callback.record["verdict"] == "healthy" and len(callback.watch.checked) == 3
    for a, b in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_compute_loss_that_divides_by_k_again_is_a_double_average():
    handler = _Collect()
    logging.getLogger("transformers").addHandler(handler)
    try:
        _, callback = _run("double-average")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    found = {f.kind: f for f in callback.findings}
    assert set(found) == {"double-average"}
    finding = found["double-average"]
    assert finding.severity == "error" and finding.rung == "watch"
    assert finding.location.line == marked_line(LOOP, "double-average")
    assert finding.evidence["measured"] == pytest.approx(1 / K, rel=1e-4)
    assert finding.evidence["framework"] == "HF Trainer"
    assert "compute_loss" in finding.fix                   # said in the Trainer's terms
    # said in the Trainer's log too, with the line
    assert any("double-average" in m and f"hf_trainer.py:{finding.location.line}" in m
               for m in handler.messages)
    assert callback.record["verdict"] == "failed"


def test_a_model_loss_that_ignores_num_items_is_a_weighted_average_mismatch():
    _, callback = _run("weighted-average-mismatch")
    found = {f.kind: f for f in callback.findings}
    assert set(found) == {"weighted-average-mismatch"}
    finding = found["weighted-average-mismatch"]
    assert finding.location.line == marked_line(LOOP, "weighted-average-mismatch")
    ev = finding.evidence
    assert ev["step"] == 1 and ev["weights"] == [0.25] * K
    # the model averages over the tokens it predicts: all real labels but each row's first
    predicted = [sum(int(r["labels"][1:].ne(IGNORE).sum()) for r in micro)
                 for micro in _window_rows(1)]
    assert ev["reference_weights"] == pytest.approx([p / sum(predicted) for p in predicted],
                                                    abs=1e-6)
    assert ev["hypothesis_error"] < 1e-4
    assert "num_items_in_batch" in finding.fix


@pytest.mark.parametrize("ragged", [True, False])
def test_a_model_loss_that_takes_loss_kwargs_and_ignores_them_is_a_missing_average(ragged):
    """The Trainer passes num_items_in_batch and leaves the division to the loss; the loss
    averages each micro-batch alone: K x the equal-weight mean of the micro-batch means."""
    _, callback = _run("missing-accumulation-average", ragged=ragged)
    found = {f.kind: f for f in callback.findings}
    assert set(found) == {"missing-accumulation-average"}
    finding = found["missing-accumulation-average"]
    assert finding.location.line == marked_line(LOOP, "missing-accumulation-average")
    assert finding.evidence["factor"] == K and finding.evidence["hypothesis_error"] < 1e-4
    assert "num_items_in_batch" in finding.fix


def test_on_error_raise_stops_the_trainer_and_leaves_torch_as_it_was():
    backward, clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_
    with pytest.raises(ampdoctor.WatchError, match="double-average") as info:
        _run("double-average", on_error="raise", steps=4)
    assert info.value.finding.location.line == marked_line(LOOP, "double-average")
    assert torch.Tensor.backward is backward and torch.nn.utils.clip_grad_norm_ is clip


def test_an_error_in_a_training_step_leaves_torch_as_it_was(tmp_path):
    from hf_trainer import build_model
    from transformers import Trainer, TrainingArguments

    class Failing(Trainer):
        calls = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            Failing.calls += 1
            if Failing.calls == 6:
                raise RuntimeError("the user's loss failed")
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
    backward, clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_
    model = build_model()
    callback = ampdoctor.WatchCallback(every=1)
    trainer = Failing(model=model, train_dataset=rows(4 * K * B), callbacks=[callback],
                      args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                             per_device_train_batch_size=B,
                                             gradient_accumulation_steps=K, max_steps=4,
                                             report_to="none", disable_tqdm=True))
    with pytest.raises(RuntimeError, match="the user's loss failed"):
        trainer.train()
    assert torch.Tensor.backward is backward and torch.nn.utils.clip_grad_norm_ is clip
    assert "training_step" not in vars(trainer) and not model._forward_pre_hooks
    assert callback.watch.record is not None


def test_the_record_is_saved(tmp_path):
    _, callback = _run("double-average", out=tmp_path, steps=2)
    saved = list(tmp_path.glob("*.json"))
    assert len(saved) == 1 and callback.record["path"] == str(saved[0])
    assert callback.record["failed_rung"] == "watch" and callback.record["exit_code"] == 1


def test_bad_arguments_are_said_plainly():
    with pytest.raises(ValueError, match="every"):
        ampdoctor.WatchCallback(every=0)
    with pytest.raises(ValueError, match="on_error"):
        ampdoctor.WatchCallback(on_error="panic")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the Trainer scales the loss in fp16 only on a GPU (no GradScaler on "
                           "a CPU): nothing to clip under")
@pytest.mark.parametrize("bug", ["none", "clip-before-unscale"])
def test_fp16_on_a_gpu_a_clip_in_training_step_clips_scaled_gradients(bug):
    _, callback = _run(bug, "fp16", steps=4, device="cuda")
    found = {f.kind: f for f in callback.findings}
    if bug == "none":
        assert callback.record["verdict"] == "healthy" and found == {}
    else:
        assert "clip-before-unscale" in found, found
        assert found[bug].location.line == marked_line(LOOP, bug)
