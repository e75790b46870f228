"""Forwards matched to the micro-batch they consume (by storage), and RNG alignment."""

from __future__ import annotations

import torch

from ampdoctor.probe.recorder import ForwardAligner, MicroBatchIndex


def _batches(n=4):
    return [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(n)]


def test_a_forward_is_matched_by_storage_through_views_and_dicts():
    mbs = _batches()
    index = MicroBatchIndex(mbs)
    x, _ = mbs[2]
    assert index.find((x[:, :-1],), {}) == 2          # a view keeps the storage
    assert index.find((), {"input": mbs[3][0]}) == 3  # keyword arguments too
    assert index.find((x * 2,), {}) is None           # a new tensor is not a micro-batch


def test_fetch_ahead_forwards_are_attributed_to_what_they_consumed():
    mbs = _batches()
    model = torch.nn.Linear(3, 1)
    seen = []
    aligner = ForwardAligner(MicroBatchIndex(mbs), None, seen.append).attach(model)
    it = iter(mbs)
    x, _ = next(it)
    for _ in range(len(mbs)):
        model(x)
        x, _ = next(it, (None, None))  # prefetch before backward, as nanoGPT does
    aligner.detach()
    assert seen == [0, 1, 2, 3]


def test_aligned_dropout_masks_repeat_per_micro_batch_and_leave_the_outer_stream():
    mbs = _batches()
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5)).train()
    aligner = ForwardAligner(MicroBatchIndex(mbs), seed=7).attach(model)
    torch.manual_seed(1)
    first = [model(x) for x, _ in mbs]
    after_first = torch.rand(1)
    torch.manual_seed(2)
    second = [model(x) for x, _ in reversed(mbs)][::-1]
    after_second = torch.rand(1)
    aligner.detach()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # the RNG stream outside the forward is the caller's own
    assert not torch.equal(after_first, after_second)
