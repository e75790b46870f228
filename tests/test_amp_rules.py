"""Small rules of the AMP rungs: rounding noise vs a bug, a backend limit vs the user's error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ampdoctor.ladder.amp import _backend_cannot
from ampdoctor.maths import compare


def _metrics(ratio, cosine):
    return compare.Metrics(rel_err=0.07, ratio=ratio, cosine=cosine, norm_user=ratio,
                           norm_ref=1.0, ok=False, allowed=0.05)


@pytest.mark.parametrize("precision,ratio,cosine,noise", [
    ("bf16", 1.0003, 0.998, True),     # BatchNorm CNN in bf16: measured 6.3e-2, cos 0.998
    ("fp16", 0.97, 0.97, True),
    ("fp32", 1.0003, 0.998, False),    # fp32 has no rounding excuse
    ("bf16", 2.0, 1.0, False),         # a factor K=2 is a bug
    ("bf16", 0.5, 1.0, False),         # 1/K
    ("fp16", 1.0, 0.8, False),         # turned: weighting or zero_grad shapes
])
def test_precision_noise(precision, ratio, cosine, noise):
    assert compare.is_precision_noise(_metrics(ratio, cosine), precision) is noise


def _session(fp32_error=None):
    return SimpleNamespace(traces={"fp32": SimpleNamespace(error=fp32_error)},
                           device=torch.device("cpu"))


@pytest.mark.parametrize("error,blamed_on_backend", [
    (RuntimeError("could not create a primitive descriptor for the LSTM forward"), True),
    (RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\''), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("could not create a primitive"), False),
])
def test_backend_limits(error, blamed_on_backend):
    trace = SimpleNamespace(error=error)
    assert _backend_cannot(_session(), trace) is blamed_on_backend


def test_backend_limit_needs_a_working_fp32_run():
    trace = SimpleNamespace(error=RuntimeError("could not create a primitive"))
    assert _backend_cannot(_session(fp32_error=RuntimeError("boom")), trace) is False
