"""A run's outcome crosses from the run's process to the worker through `spawn.dumps`: its plain
CPU tensors as raw bytes (torch's own pickling writes each storage as a small archive). What
arrives must be the same tensors: dtype, shape, values, requires_grad, and one object where the
outcome held one object twice; anything else (a Parameter, a tensor with attributes of its own)
goes through torch's pickling as before."""

from __future__ import annotations

import pickle

import pytest
import torch

from ampdoctor.script.spawn import dumps

CASES = {
    "fp32 matrix": torch.randn(3, 4),
    "bf16": torch.randn(5, dtype=torch.bfloat16),
    "fp16": torch.randn(7, dtype=torch.float16),
    "fp64": torch.randn(2, 2, dtype=torch.float64),
    "0-dim": torch.tensor(3.0),
    "empty": torch.zeros(0, 3),
    "transposed view": torch.randn(4, 3).t(),
    "strided slice": torch.arange(12).reshape(3, 4)[:, 1],
    "bool": torch.tensor([True, False, True]),
    "leaf requiring grad": torch.randn(2, requires_grad=True),
    "parameter": torch.nn.Parameter(torch.randn(2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_tensor_arrives_as_it_left(name: str) -> None:
    sent = CASES[name]
    got = pickle.loads(dumps(sent))
    assert type(got) is type(sent)
    assert got.dtype == sent.dtype and got.shape == sent.shape
    assert got.requires_grad == sent.requires_grad
    assert torch.equal(got.detach(), sent.detach())
    got.detach().zero_()      # its own memory, writable (not the bytes of the message)
    assert got.detach().count_nonzero() == 0


def test_one_tensor_twice_stays_one_object() -> None:
    t = torch.randn(3)
    state = {"w": t}
    got = pickle.loads(dumps({"first": state, "initial": state, "again": t}))
    assert got["first"] is got["initial"]
    assert got["again"] is got["first"]["w"]


def test_a_tensor_with_attributes_of_its_own_keeps_them() -> None:
    t = torch.randn(2)
    t.note = "kept"     # type: ignore[attr-defined]
    got = pickle.loads(dumps(t))
    assert got.note == "kept" and torch.equal(got, t)

