"""The overlay (`files`) for writers that open their path outside Python: torch.save and
torch.load (C++), safetensors' `serialize_file` and `safe_open` (Rust), through which
`safetensors.torch.save_file`/`load_file`, the HF Trainer's `save_model` and checkpoints and
accelerate's `save_state` go. Each gets the shadow of the path it was given (`Overlay.write` /
`Overlay.read`), so a script that saves into a folder it made (in the scratch) finds the
folder, and reads back what it wrote."""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Any, Protocol

from ..probe import patches


class Overlay(Protocol):
    """What of `files.Overlay` the writers use: the shadow of a path to write, or to read."""

    def write(self, path: Any, keep: bool) -> Any: ...

    def read(self, path: Any) -> Any: ...


def install(overlay: Overlay, patcher: patches.Patcher) -> None:
    _torch(overlay, patcher)
    if importlib.util.find_spec("safetensors") is not None:
        _safetensors(overlay, patcher)


def _path_arg(f: Any) -> bool:
    import os
    return isinstance(f, (str, os.PathLike))


def _torch(overlay: Overlay, patcher: patches.Patcher) -> None:
    import torch

    save, load = torch.save, torch.load

    @functools.wraps(save)
    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        return save(obj, overlay.write(f, keep=False) if _path_arg(f) else f, *args, **kwargs)

    @functools.wraps(load)
    def torch_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        return load(overlay.read(f) if _path_arg(f) else f, *args, **kwargs)

    patcher.setattr(torch, "save", torch_save)
    patcher.setattr(torch, "load", torch_load)


def _safetensors(overlay: Overlay, patcher: patches.Patcher) -> None:
    """`serialize_file` is looked up in its module at each call (every `save_file` goes
    through it); `safe_open` is bound by name in the modules that imported it (transformers'
    `from safetensors import safe_open`): rebound in each module loaded now, and in the package
    for the modules loaded later."""
    import safetensors

    real_serialize = safetensors.serialize_file
    real_open = safetensors.safe_open

    @functools.wraps(real_serialize)
    def serialize_file(tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> Any:
        if _path_arg(filename):
            filename = overlay.write(filename, keep=False)
        return real_serialize(tensors, filename, *args, **kwargs)

    def safe_open(filename: Any, *args: Any, **kwargs: Any) -> Any:
        return real_open(overlay.read(filename) if _path_arg(filename) else filename,
                         *args, **kwargs)

    from . import prefork
    patched = {"serialize_file": serialize_file, "safe_open": safe_open}
    for name, attr in prefork.safetensors_holders():
        patcher.setattr(sys.modules[name], attr, patched[attr])
