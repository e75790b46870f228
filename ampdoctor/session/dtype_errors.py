"""Which field of the data a dtype error blames: the data factory returned a field in a dtype
the user's code cannot compute with (integers where a float is needed, float64 for a float32
model), and torch's error names that dtype (`data_dtype_culprit`)."""

from __future__ import annotations

import re
from typing import Any

import torch

from ..core.errors import exc_text

#: torch's names for a dtype in its error messages: `Long`, `torch.int64`, `torch.LongTensor`.
_SCALAR_NAMES = {
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
    torch.uint8: "Byte", torch.bool: "Bool", torch.float64: "Double", torch.float16: "Half",
    torch.bfloat16: "BFloat16", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}
#: The C names torch's older kernels use (`expected m1 and m2 to have the same dtype, but got:
#: long int != float`).
_C_NAMES = {torch.int64: "long int", torch.float64: "double", torch.uint8: "unsigned char"}
#: What an error says it expected, not what it got: "expected scalar type Float", "one of the
#: following scalar types: Long, Int;" -- a field of that dtype is not the culprit.
_EXPECTED = re.compile(r"one of the following scalar types:[^;]*;?|"
                       r"expected (?:scalar type |dtype |type )?[A-Za-z0-9_.]+", re.IGNORECASE)
#: An error about dtypes (not about shapes or devices).
_DTYPE_COMPLAINT = re.compile(r"dtype|scalar type|Tensor\b|type \(|not implemented for|"
                              r"can't be cast|cannot be cast|to have one of the following",
                              re.IGNORECASE)


def _dtype_names(dtype: torch.dtype) -> list[str]:
    short = str(dtype).removeprefix("torch.")
    names = [re.escape(f"torch.{short}"), rf"\b{re.escape(short)}\b"]
    scalar = _SCALAR_NAMES.get(dtype)
    if scalar is None and dtype.is_floating_point:   # float8 variants: Float8_e4m3fn
        scalar = short[0].upper() + short[1:]
    if scalar:
        names.append(rf"(?<![A-Za-z]){re.escape(scalar)}(?![a-z])")   # Long, LongTensor
    if dtype in _C_NAMES:
        names.append(rf"\b{_C_NAMES[dtype]}\b")
    return names


def data_dtype_culprit(exc: BaseException, mbs: list[Any]) -> tuple[str, torch.Tensor] | None:
    """The field of the micro-batches whose dtype a dtype error names, when one does: a field
    that is not float32 (the model's dtype) whose dtype the error message names. None when the
    error is about something else, or names no field's dtype."""
    text = exc_text(exc, 2000)
    if not isinstance(exc, (RuntimeError, TypeError, ValueError, NotImplementedError)) \
            or not _DTYPE_COMPLAINT.search(text) or not mbs:
        return None
    got = _EXPECTED.sub(" ", text)
    first = mbs[0]
    fields = list(first.items()) if isinstance(first, dict) else list(enumerate(first))
    for key, t in fields:
        if not isinstance(t, torch.Tensor) or t.dtype == torch.float32:
            continue
        if any(re.search(name, got) for name in _dtype_names(t.dtype)):
            return (f"field {key!r}" if isinstance(key, str) else f"field {key}"), t
    return None
