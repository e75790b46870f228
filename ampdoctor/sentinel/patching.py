"""How the sentinel puts its wrappers in place and takes them out again, exactly."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

from ..probe.callsite import _AMPDOCTOR_DIR, CallSiteFinder, Site, _torch_dir


class Patching:
    """Patches undone in reverse order by running `_undo` backwards (`Watch.__exit__`)."""

    _undo: list[Callable[[], None]]

    def _patch_attr(self, owner: Any, name: str, value: Any) -> None:
        original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def _patch_instance(self, obj: Any, name: str, value: Any) -> None:
        """`obj.name` becomes `value` for `obj` alone. Patched on the class that defines the
        method, dispatching on identity: an attribute of the instance would travel with it
        (a scheduler's `state_dict()` is its `__dict__`, so a checkpoint would fail to pickle
        the wrapper or load it back; `copy.deepcopy(model)` for an EMA would share it)."""
        owner = next((c for c in type(obj).__mro__ if name in vars(c)), None)
        method = vars(owner).get(name) if owner is not None else None
        if owner is not None and name not in vars(obj) and inspect.isfunction(method):
            def dispatch(this: Any, *args: Any, **kwargs: Any) -> Any:
                if this is obj:
                    return value(*args, **kwargs)
                return method(this, *args, **kwargs)
            functools.update_wrapper(dispatch, method)
            setattr(owner, name, dispatch)
            self._undo.append(lambda: setattr(owner, name, method))
            return
        had = name in obj.__dict__
        original = obj.__dict__.get(name)
        obj.__dict__[name] = value

        def undo() -> None:
            if had:
                obj.__dict__[name] = original
            else:
                obj.__dict__.pop(name, None)
        self._undo.append(undo)


def direct_site(frame: Any, finder: CallSiteFinder) -> Site | None:
    """The caller past ampdoctor's and torch's own frames when it is the user's code (not a
    framework's or the standard library's), else None."""
    torch_dir = _torch_dir()
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(
            (_AMPDOCTOR_DIR, torch_dir)):
        frame = frame.f_back
    if frame is None or finder._classify(frame.f_code.co_filename)[0]:
        return None
    return Site(os.path.realpath(frame.f_code.co_filename), frame.f_lineno,
                frame.f_code.co_name)
