"""Install and restore the probe's patches on torch, exactly.

Like pytest's MonkeyPatch: every `setattr` remembers the value found in the target's own
`__dict__` (or that there was none), and `undo()` restores in reverse order; undo twice is
harmless. `installed()` is a context manager, so any exit (finding, user exception, Ctrl-C)
leaves torch as it found it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

_NOTSET = object()


class Patcher:
    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        old = target.__dict__.get(name, _NOTSET) if hasattr(target, "__dict__") else _NOTSET
        if old is _NOTSET and hasattr(target, name) and not isinstance(target, type):
            old = getattr(target, name)
        self._saved.append((target, name, old))
        setattr(target, name, value)

    def add_handle(self, handle: Any) -> None:
        """A removable hook handle (e.g. a global optimizer step hook)."""
        self._handles.append(handle)

    @property
    def patched(self) -> list[tuple[Any, str, Any]]:
        return list(self._saved)

    def undo(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._saved:
            target, name, old = self._saved.pop()
            if old is _NOTSET:
                with contextlib.suppress(AttributeError):
                    delattr(target, name)
            else:
                setattr(target, name, old)


@contextlib.contextmanager
def installed(install: Callable[[Patcher], object]) -> Iterator[Patcher]:
    """Run `install(patcher)` and undo everything on exit, whatever the exit."""
    patcher = Patcher()
    try:
        install(patcher)
        yield patcher
    finally:
        patcher.undo()
