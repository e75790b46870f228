"""Unit tests of the comparison maths: metrics, clipping, and hypothesis classification.

The numbers follow the article's section 4: per-micro-batch gradients 1, 2, 3 with K = 3 and
S = 8 give a correct step gradient of 2.0; forgetting / K gives 6.0; clipping in scaled space
with max_norm 1 leaves 1/S.
"""

from __future__ import annotations

import math

import pytest
import torch

from ampdoctor.maths import compare

TOL = compare.DEFAULT_TOLERANCES["fp32"]


def _per_mb():
    # three micro-batches, a two-parameter model; micro-batch k's gradient is k+1 along e0 plus
    # a little of e1 so that vectors are not all parallel
    return [torch.tensor([1.0, 0.1]), torch.tensor([2.0, -0.3]), torch.tensor([3.0, 0.5])]


def _classify(user, per_mb, counts=None, weighted=False, scale=None, K=3):
    counts = counts or [4.0] * len(per_mb)
    if weighted:
        total = sum(counts)
        ref = sum(g * n for g, n in zip(per_mb, counts, strict=True)) / total
    else:
        ref = torch.stack(per_mb).mean(0)
    hyps = compare.window_hypotheses(per_mb, counts, weighted, ref, K)
    hyps += compare.scale_hypotheses(ref, scale)
    return ref, compare.classify(user, ref, hyps, 2e-3)


def test_article_worked_numbers():
    g = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])]
    ref = torch.stack(g).mean(0)
    assert float(ref) == pytest.approx(2.0)
    # forgetting / K: 6.0, ratio K
    m = compare.metrics(torch.tensor([6.0]), ref, TOL)
    assert not m.ok and m.ratio == pytest.approx(3.0)
    # clipping in scaled space (S=8, max_norm=1): the scaled grad 16 is clipped to 1, then
    # unscaled to 1/8
    scaled = ref * 8
    clipped = compare.clip_vector(scaled, 1.0) / 8
    assert float(clipped) == pytest.approx(1 / 8, rel=1e-5)
    # clipping in true space leaves 1.0 (norm 2 clipped to 1)
    assert float(compare.clip_vector(ref, 1.0)) == pytest.approx(1.0, rel=1e-5)


def test_metrics_healthy_within_tolerance():
    ref = torch.tensor([1.0, 2.0, 3.0])
    m = compare.metrics(ref * (1 + 1e-7), ref, TOL)
    assert m.ok
    assert m.cosine == pytest.approx(1.0)
    m = compare.metrics(ref * 1.01, ref, TOL)
    assert not m.ok
    assert m.rel_err == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("transform,kind,factor", [
    (lambda per, ref: torch.stack(per).sum(0), "missing-accumulation-average", 3.0),
    (lambda per, ref: ref / 3, "double-average", 1 / 3),
    (lambda per, ref: ref * 4, "reduction-mismatch", 4.0),       # sum over b=4 samples, / K
    (lambda per, ref: per[-1] / 3, "zero-grad-inside-accumulation", None),
    (lambda per, ref: per[-1], "zero-grad-inside-accumulation", None),
    (lambda per, ref: (per[1] + per[2]) / 3, "zero-grad-inside-accumulation", None),
    (lambda per, ref: ref * 8, "missing-unscale", 8.0),
    (lambda per, ref: ref / 8, "unscale-twice", 1 / 8),
])
def test_classify_known_shapes(transform, kind, factor):
    per = _per_mb()
    ref = torch.stack(per).mean(0)
    _, found = _classify(transform(per, ref), per, scale=8.0)
    assert found is not None
    assert found.kind == kind
    if factor is not None:
        assert found.factor == pytest.approx(factor)


def test_weighted_average_mismatch_is_recognised():
    per = _per_mb()
    counts = [5.0, 40.0, 60.0]   # tokens per micro-batch
    equal_weight = torch.stack(per).mean(0)
    ref, found = _classify(equal_weight, per, counts=counts, weighted=True)
    assert compare.metrics(equal_weight, ref, TOL).ok is False
    assert found is not None and found.kind == "weighted-average-mismatch"


def test_healthy_gradient_is_not_explained_by_any_hypothesis():
    per = _per_mb()
    ref = torch.stack(per).mean(0)
    _, found = _classify(ref.clone(), per, scale=8.0)
    assert found is None


def test_random_difference_matches_no_shape():
    per = _per_mb()
    ref = torch.stack(per).mean(0)
    _, found = _classify(ref + torch.tensor([0.3, -0.7]), per, scale=8.0)
    assert found is None


def test_nearest_integer_factor():
    assert compare.nearest_integer_factor(8.0, 8) == 1
    assert compare.nearest_integer_factor(16.05, 8) == 2
    assert compare.nearest_integer_factor(5.0, 8) is None
    assert compare.nearest_integer_factor(math.inf, 8) is None


def test_flatten_fills_missing_grads_with_zeros():
    shapes = {"a": torch.Size([2]), "b": torch.Size([1, 2])}
    v = compare.flatten({"a": torch.tensor([1.0, 2.0]), "b": None}, ["a", "b"], shapes)
    assert v.tolist() == [1.0, 2.0, 0.0, 0.0]


def test_micro_batch_counts_names_what_a_loss_can_average_over():
    import torch

    from ampdoctor.loading import micro_batch_counts

    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    counts = micro_batch_counts({"input_ids": torch.ones(2, 4, dtype=torch.long),
                                 "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
                                 "labels": labels})
    assert counts["samples"] == 2
    assert counts["labels of `labels` that are not -100"] == 5
    assert counts["next-token targets of `labels`[:, 1:]"] == 3
    assert counts["ones of the mask `attention_mask`"] == 5
    assert counts["elements of `labels` (2 x 4)"] == 8
    # the targets come first: a loss most often counts its labels
    assert list(counts)[1].endswith("`labels` (2 x 4)")
    tuple_counts = micro_batch_counts((torch.zeros(8, 16), torch.zeros(8, 3)))
    assert tuple_counts == {"samples": 8, "elements of field 0 (8 x 16)": 128,
                            "elements of field 1 (8 x 3)": 24}
