"""Per-step copies a run must keep until it is judged, held on disk instead of in memory.

A trace keeps, per optimizer step, the gradients the step consumed and the parameters it saw: two
copies of the model per step, the bulk of a diagnose's memory on a large model (and growing with
optimizer_steps). Above `SPILL_BYTES` per copy, the probe writes each copy to a temporary file
(in a background thread) and keeps a `Spilled` mapping: its keys without loading, its tensors
loaded on first access (one copy at a time is cached, so the judge reading a step's gradients
name by name loads them once).
The round trip is exact (torch.save / torch.load), so nothing judged changes. The first
`KEEP_IN_MEMORY` large copies alive at a time stay in memory (`_Kept`): a disk round trip costs
more than the copy, and a fixed number keeps memory flat in optimizer_steps.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Iterator, KeysView, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..core import processes

#: A copy at least this large (bytes) is spilled; smaller ones stay in memory.
SPILL_BYTES = 32 * 2**20
#: ... unless fewer than this many such copies are in memory: those stay.
KEEP_IN_MEMORY = 2
_KEPT = 0
#: At most this many spilled copies wait in memory for the background writer.
MAX_PENDING = 2
_PENDING: list = []

_DIR: tempfile.TemporaryDirectory | None = None
_CACHE: tuple[str, dict[str, Any]] | None = None
_COUNT = 0


_WRITER: ThreadPoolExecutor | None = None


def _writer() -> ThreadPoolExecutor:
    global _WRITER
    if _WRITER is None:
        _WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ampdoctor-spill")
    return _WRITER


def _directory() -> str:
    global _DIR
    if _DIR is None:
        _DIR = tempfile.TemporaryDirectory(prefix="ampdoctor-spill-",
                                           dir=processes.temp_root())
    return _DIR.name


def size_of(tensors: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values()
               if isinstance(t, torch.Tensor))


class Spilled(Mapping):
    """A dict of tensors kept in a file; read like the dict it was."""

    def __init__(self, tensors: dict[str, Any]):
        global _COUNT
        _COUNT += 1
        self.path = os.path.join(_directory(), f"{_COUNT}.pt")
        self._keys = list(tensors)
        #: the tensors until they are on disk: written by a background thread, so the run goes
        #: on meanwhile, and read from memory until the write is done
        self._tensors: dict[str, Any] | None = tensors
        # Backpressure: when the disk falls behind the run, at most MAX_PENDING copies wait in
        # memory for their write (else they would pile up, one per step).
        while len(_PENDING) >= MAX_PENDING:
            _PENDING.pop(0).result()
        self._written = _writer().submit(self._write)
        _PENDING.append(self._written)

    def _write(self) -> None:
        tensors = self._tensors
        if tensors is not None:
            torch.save(tensors, self.path)
        self._tensors = None

    def _load(self) -> dict[str, Any]:
        global _CACHE
        tensors = self._tensors
        if tensors is not None:
            return tensors
        self._written.result()
        if _CACHE is None or _CACHE[0] != self.path:
            _CACHE = None
            _CACHE = (self.path, torch.load(self.path, weights_only=True))
        return _CACHE[1]

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._load()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> KeysView[str]:
        return dict.fromkeys(self._keys).keys()

    def read_fresh(self) -> dict[str, Any]:
        """The tensors as a dict of their own, read again from the file (the one-copy cache
        neither used nor filled: what is read lives as long as the caller holds it)."""
        tensors = self._tensors
        if tensors is not None:
            return dict(tensors)
        self._written.result()
        return torch.load(self.path, weights_only=True)

    def release(self) -> None:
        global _CACHE
        self._written.result()
        if _CACHE is not None and _CACHE[0] == self.path:
            _CACHE = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def __del__(self) -> None:
        # (not contextlib.suppress: at interpreter exit the module's globals may be gone)
        try:  # noqa: SIM105
            self.release()
        except Exception:  # noqa: BLE001 - a finaliser never raises
            pass


class _Kept(dict):
    """A large copy kept in memory: counted while it is alive."""

    def __init__(self, tensors: dict[str, Any]):
        global _KEPT
        super().__init__(tensors)
        _KEPT += 1
        weakref.finalize(self, _forget_kept)


def _forget_kept() -> None:
    global _KEPT
    _KEPT -= 1


def maybe_spill(tensors: dict[str, Any]) -> Mapping[str, Any]:
    """`tensors` as they are, or spilled to disk when they are large and KEEP_IN_MEMORY
    large copies are already in memory."""
    if size_of(tensors) < SPILL_BYTES:
        return tensors
    if _KEPT < KEEP_IN_MEMORY:
        return _Kept(tensors)
    return Spilled(tensors)


def to_disk(tensors: Mapping[str, Any]) -> Mapping[str, Any]:
    """A large copy moved to disk whatever is in memory (one kept for long, not read again
    until much later); a small one, or one already on disk, as it is."""
    if isinstance(tensors, Spilled) or size_of(tensors) < SPILL_BYTES:
        return tensors
    return Spilled(dict(tensors))


def forget_cache() -> None:
    global _CACHE
    _CACHE = None
