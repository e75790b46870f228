"""The data slice: cut into micro-batches, checked usable (dense, finite), moved to the
device, and described (what a loss might average over)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import SpecError, UserCodeError
from ..spec import Spec
from .naming import factory_name, spec_where, unusable


def _is_tensor_tuple(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(
        isinstance(t, torch.Tensor) for t in value)


def _is_micro_batch(value: Any) -> bool:
    if isinstance(value, dict):
        return len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value.values())
    return _is_tensor_tuple(value)


def _unusable_tensor(t: torch.Tensor) -> tuple[str, str] | None:
    """Why ampdoctor cannot use a tensor of the data slice, as (what it is, why and what to do),
    or None. ampdoctor cuts the slice into micro-batches, copies them to the device,
    concatenates a window's for the reference and matches each forward to its micro-batch by
    the tensor's storage: it needs dense tensors that hold values. (Integer and bool tensors
    are fine: token ids, labels, masks.)"""
    if t.is_meta:
        return ("on the meta device",
                ("a meta tensor holds no values, so nothing can be trained or compared. Return "
                 "real tensors (on the CPU or the GPU)"))
    if t.is_nested:
        return ("as a nested tensor (torch.nested)",
                ("ampdoctor cuts, concatenates and matches micro-batches by their dense "
                 "storage. Return padded dense tensors (`t.to_padded_tensor(0)`), or a list of "
                 "micro-batches whose tensors may differ in length from one micro-batch to the "
                 "next"))
    if t.layout != torch.strided:
        return (f"as a sparse tensor (layout {t.layout})",
                ("ampdoctor cuts the slice into micro-batches, concatenates a window's "
                 "micro-batches for its reference and matches each forward to its micro-batch "
                 "by the tensor's storage, none of which a sparse tensor supports. Return dense "
                 "tensors (`t.to_dense()`); a model that wants sparse input can convert in its "
                 "forward"))
    if t.is_quantized:
        return ("as a quantized tensor",
                ("autocast and the fp32 reference need real values. Return the float tensor "
                 "(`t.dequantize()`)"))
    return None


def _check_tensors(spec: Spec, factory: str, named: list[tuple[str, Any]]) -> None:
    for where, t in named:
        if not isinstance(t, torch.Tensor):
            continue
        why = _unusable_tensor(t)
        if why is not None:
            shape = "" if t.is_nested else f", shape {tuple(t.shape)}"
            raise unusable(spec, "data", f"{factory} returned {where} ({t.dtype}{shape}) "
                           f"{why[0]}: {why[1]}.")


def _field_name(key: Any) -> str:
    return f"field {key!r}" if isinstance(key, str) else f"field {key}"


def cut_micro_batches(data: Any, spec: Spec, factory_fn: Any = None) -> list[Any]:
    """Cut the slice into exactly optimizer_steps * K micro-batches (CONTRACT §1 `data`).
    A slice ampdoctor cannot use (the wrong structure, meta, sparse, nested or quantized
    tensors) is refused naming the data factory, the micro-batch and the field (exit 2)."""
    needed = spec.optimizer_steps * spec.accumulation_steps
    factory = factory_name(spec, "data", factory_fn)
    if _is_tensor_tuple(data):
        tensors = list(data)
        _check_tensors(spec, factory, [(f"tensor {i} of the slice", t)
                                       for i, t in enumerate(tensors)])
        length = tensors[0].shape[0] if tensors[0].dim() > 0 else 0
        if any(t.dim() == 0 or t.shape[0] != length for t in tensors):
            raise unusable(spec, "data", f"{factory} returned tensors whose first dimensions "
                           f"differ ({[tuple(t.shape) for t in tensors]}); a slice of tensors "
                           "must share its first (sample) dimension.")
        b = spec.micro_batch_size
        if b is None:
            raise SpecError(f"{spec_where(spec, 'micro_batch_size')}spec key "
                            "'micro_batch_size': required because the data factory returns a "
                            "tuple of tensors that ampdoctor cuts into micro-batches.")
        if length < needed * b:
            raise SpecError(f"{spec_where(spec, 'micro_batch_size')}spec key "
                            f"'micro_batch_size': the data slice holds {length} "
                            f"samples but optimizer_steps x accumulation_steps x "
                            f"micro_batch_size = {spec.optimizer_steps} x "
                            f"{spec.accumulation_steps} x {b} = {needed * b} are needed.")
        return [tuple(t[i * b:(i + 1) * b] for t in tensors) for i in range(needed)]
    if isinstance(data, (list, tuple)) and data and all(_is_micro_batch(m) for m in data):
        if len(data) < needed:
            raise SpecError(f"{spec_where(spec, 'optimizer_steps')}spec key "
                            f"'optimizer_steps': the data factory returned "
                            f"{len(data)} micro-batches but optimizer_steps x "
                            f"accumulation_steps = {needed} are needed.")
        _check_tensors(spec, factory, [
            (f"micro-batch {index}, {_field_name(key)}", t)
            for index, mb in enumerate(data[:needed])
            for key, t in (mb.items() if isinstance(mb, dict) else enumerate(mb))])
        return [dict(m) if isinstance(m, dict) else tuple(m) for m in data[:needed]]
    hint = ""
    if isinstance(data, torch.Tensor):
        hint = " To give one tensor, return it in a tuple: `return (x,)`."
    elif hasattr(data, "__iter__") and not isinstance(data, (list, tuple, dict)):
        hint = (f" To use a {type(data).__name__}, return its first batches as a list: "
                f"`list(itertools.islice(loader, {needed}))`.")
    raise unusable(spec, "data", (
        f"{factory} must return a tuple/list of tensors with the same first dimension, or a "
        "list of micro-batches (tuples or dicts of tensors); it returned "
        f"{'None' if data is None else 'a ' + type(data).__name__}.{hint}"))


def check_finite(micro_batches: list[Any]) -> None:
    for index, mb in enumerate(micro_batches):
        values = mb.items() if isinstance(mb, dict) else enumerate(mb)
        for key, tensor in values:
            if not (tensor.is_floating_point() or tensor.is_complex()):
                continue
            if not _all_finite(tensor):
                raise UserCodeError(
                    f"the data slice has NaN/inf in micro-batch {index} (field {key!r}): the "
                    "fp32 baseline itself would not be finite, so no comparison means anything. "
                    "Give ampdoctor a finite slice.")


def _all_finite(tensor: torch.Tensor) -> bool:
    try:
        return bool(torch.isfinite(tensor).all())
    except (RuntimeError, NotImplementedError):   # no isfinite kernel (float8): upcast
        return bool(torch.isfinite(tensor.float()).all())


def to_device(mb: Any, device: torch.device) -> Any:
    if isinstance(mb, dict):
        return {k: v.to(device) for k, v in mb.items()}
    return tuple(t.to(device) for t in mb)


def merge_micro_batches(mbs: list[Any]) -> Any | None:
    """One micro-batch holding a whole window's data (for the loop-as-reference at K = 1), or
    None when the micro-batches cannot be concatenated (different sequence lengths) or there are
    none to concatenate (a script's session holds no data of its own)."""
    if not mbs:
        return None
    first = mbs[0]
    try:
        if isinstance(first, dict):
            return {k: torch.cat([mb[k] for mb in mbs]) for k in first}
        return tuple(torch.cat([mb[i] for mb in mbs]) for i in range(len(first)))
    except (RuntimeError, KeyError, IndexError):
        return None


def micro_batch_size_of(mb: Any) -> int:
    tensors = list(mb.values()) if isinstance(mb, dict) else list(mb)
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1


def micro_batch_counts(mb: Any) -> dict[str, float]:
    """What a loss might average over in one micro-batch, by description: its samples, the
    elements of each multi-dimensional tensor, the labels of an integer tensor that are not
    -100 (as given, and shifted for next-token prediction: `[:, 1:]`), the ones of a 0/1 mask.
    Fields named like labels/targets come first: what a loss counts is most often its targets."""
    fields = list(mb.items()) if isinstance(mb, dict) else list(enumerate(mb))
    fields.sort(key=lambda kv: not (isinstance(kv[0], str)
                                    and any(w in kv[0].lower() for w in ("label", "target"))))
    counts: dict[str, float] = {"samples": float(micro_batch_size_of(mb))}
    for key, t in fields:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        name = f"`{key}`" if isinstance(key, str) else f"field {key}"
        shape = " x ".join(str(d) for d in t.shape)
        if t.dim() > 1:
            counts[f"elements of {name} ({shape})"] = float(t.numel())
        if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):  # labels
            kept = float((t != -100).sum())
            if kept != t.numel():
                counts[f"labels of {name} that are not -100"] = kept
            if t.dim() == 2 and t.shape[1] > 1:
                counts[f"next-token targets of {name}[:, 1:]"] = float((t[:, 1:] != -100).sum())
        if t.dtype == torch.bool or ("mask" in str(key).lower() and not t.is_complex()
                                     and bool(((t == 0) | (t == 1)).all())):
            counts[f"ones of the mask {name}"] = float(t.sum())
    return counts

