"""`ampdoctor.watch` with a token-weighted `loss_fn` returning `(loss_sum, n_items)`.

The loop is `recipes/watch/token_loop.py`: a tiny LM on padded sequences whose real lengths
differ per micro-batch. The oracle is computed here, independently of the sentinel: the
window's token counts read off the labels, and the full-batch gradient (the window's micro-
batches concatenated into one batch, cross-entropy averaged over all its real tokens).
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import RECIPES, marked_line

LOOP = RECIPES / "watch" / "token_loop.py"
sys.path.insert(0, str(LOOP.parent))
from token_loop import IGNORE, VOCAB, corpus, train  # noqa: E402

K = 4


def _run(bug: str, precision: str, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(bug, precision, K=K, **kwargs)


def _finding(watch, kind):
    return next(f for f in watch.findings if f.kind == kind)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_healthy_token_weighted_loop_is_silent(precision):
    model, watch = _run("none", precision)
    assert watch.record["verdict"] == "healthy" and watch.findings == []
    assert len(watch.checked) >= 3 and all(c["ok"] for c in watch.checked)
    # the counts the replay weighed by are the window's real tokens (ragged)
    tokens = [int((b["labels"] != IGNORE).sum()) for b in corpus(8, 4)[K:2 * K]]
    assert watch.checked[0]["counts"] == tokens and len(set(tokens)) > 1


def test_the_watched_token_loop_trains_bit_identically():
    watched, _ = _run("none", "bf16", steps=6)
    plain, _ = _run("none", "bf16", steps=6, watched=False)
    for (name, a), b in zip(watched.state_dict().items(), plain.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def _oracle_at_step_one():
    """The window of step 1 at the weights the broken loop's step 0 left (one unwatched step,
    no dropout): the full-batch gradient and the equal-weight mean of the micro-batch means."""
    model, _ = _run("weighted-average-mismatch", "fp32", steps=1, watched=False, dropout=0.0)
    window = corpus(2 * K, 4)[K:2 * K]
    params = list(model.parameters())

    def grad(batches):
        tokens = torch.cat([b["tokens"] for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1),
                               ignore_index=IGNORE)
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]).double()
    full = grad(window)
    equal = torch.stack([grad([b]) for b in window]).mean(0)
    tokens = [int((b["labels"] != IGNORE).sum()) for b in window]
    return full, equal, tokens


def test_per_micro_batch_averaging_on_ragged_tokens_is_a_weighted_average_mismatch():
    full, equal, tokens = _oracle_at_step_one()
    _, watch = _run("weighted-average-mismatch", "fp32", dropout=0.0)
    found = _finding(watch, "weighted-average-mismatch")
    assert found.severity == "error" and found.rung == "watch"
    assert found.location.line == marked_line(LOOP, "weighted-average-mismatch")
    ev = found.evidence
    assert ev["step"] == 1
    assert ev["weights"] == [0.25] * K                    # what the run did: equal
    assert ev["reference_weights"] == pytest.approx([t / sum(tokens) for t in tokens],
                                                    abs=1e-6)
    # the numbers are the oracle's: |equal| / |full| and their cosine
    assert ev["measured"] == pytest.approx(float(equal.norm() / full.norm()), rel=1e-4)
    assert ev["cosine"] == pytest.approx(float(F.cosine_similarity(equal, full, dim=0)),
                                         abs=1e-5)
    assert ev["hypothesis_error"] < 1e-4
    assert "The run weighted its micro-batches [0.25, 0.25, 0.25, 0.25]" in found.message
    assert "gradient-mismatch" not in {f.kind for f in watch.findings}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_weighting_bug_is_named_at_its_line(precision):
    for bug, factor in [("weighted-average-mismatch", None),
                        ("missing-accumulation-average", K), ("double-average", 1 / K)]:
        _, watch = _run(bug, precision)
        kinds = {f.kind for f in watch.findings}
        assert kinds == {bug}, (bug, precision, kinds)
        found = _finding(watch, bug)
        assert found.location.line == marked_line(LOOP, bug)
        if factor is not None:
            assert found.evidence["factor"] == pytest.approx(factor)


def test_a_missing_average_over_ragged_tokens_says_both_weightings():
    _, watch = _run("missing-accumulation-average", "fp32")
    ev = _finding(watch, "missing-accumulation-average").evidence
    assert ev["weights"] == [0.25] * K and ev["factor"] == K
    assert sum(ev["reference_weights"]) == pytest.approx(1.0, abs=1e-5)
    assert ev["reference_weights"] != ev["weights"]


def test_equal_lengths_make_both_weightings_one():
    """Without ragged lengths per-micro-batch averaging is the token average: silent."""
    _, watch = _run("weighted-average-mismatch", "fp32", ragged=False)
    assert watch.findings == [] and all(c["ok"] for c in watch.checked)


def test_a_loss_fn_that_mixes_both_forms_is_said_and_not_checked():
    import ampdoctor
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def loss_fn(m, batch):
        calls.append(1)
        loss = m(batch).pow(2).sum()
        return (loss, 3) if len(calls) % 2 else loss / 3
    data = [torch.randn(3, 3) for _ in range(8)]
    with pytest.warns(UserWarning, match="a scalar for some micro-batches"), \
            ampdoctor.watch(model, opt, accumulation_steps=2, loss_fn=loss_fn) as w:
        for i, x in enumerate(w.batches(data)):
            (model(x).pow(2).sum() / 6).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
    assert w.checked == [] and w.findings == []
