"""How messages about the spec's code name a spec key, its YAML line and a factory."""

from __future__ import annotations

import os
import sys
from typing import Any

from ..core.errors import AmpdoctorError, InputError
from ..spec import Spec, spec_line


def spec_where(spec: Spec, key: str) -> str:
    """`spec.yaml:LINE: ` for a message about `key` (the file alone when the line is unknown;
    nothing for a spec that has no file). A key whose value came from an override is named
    with it (`device = 'cuda' (from --device): `), never at the file's line; a message about
    a key of the file says which overrides were in effect."""
    origin = spec.origin(key)
    if origin is not None:
        # the value is not the file's: name where it came from, not the file's line
        top = key.split(".")[0]
        return f"{top} = {getattr(spec, top)!r} (from {origin}): "
    if spec.spec_path is None:
        return ""
    line = spec_line(spec, key) or (spec_line(spec, key.split(".")[0]) if "." in key else None)
    path = shown(spec.spec_path)
    overridden = spec.overridden()
    also = f", with {overridden}" if overridden else ""
    return f"{path}:{line}{also}: " if line else f"{path}{also}: "



def shown(path: Any) -> str:
    """A path as messages show it: relative to the working directory when under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def unusable(spec: Spec, key: str, message: str, *,
             cause: BaseException | None = None) -> AmpdoctorError:
    """The spec's model or data cannot be used by the triage (exit 2): what the factory named by
    `key` returned, and why. Raised once the spec was loaded, by the factory's own answer (a
    meta-device model, half-precision weights, sparse data...), not because its code raised
    (that is a UserCodeError, exit 3). An InputError names the spec key and its YAML line, and
    is recorded (a bad spec itself is not)."""
    return InputError(f"{spec_where(spec, key)}spec key '{key}': {message}", cause=cause)


def defined_at(fn: Any) -> str | None:
    """`file:line` of a callable's `def` (relative to the working directory when under it), or
    None for one without Python source (a builtin, a C extension)."""
    import inspect
    try:
        target = inspect.unwrap(fn)
        file = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (OSError, TypeError, ValueError):
        return None
    return f"{shown(file)}:{line}" if file else None


def factory_name(spec: Spec, key: str, fn: Any = None) -> str:
    """How a message names the spec's factory: `the model factory 'models:make' (models.py:12)`.
    Without `fn`, the callable is looked up among the modules already imported (never
    importing anything)."""
    what = {"model": "the model factory", "data": "the data factory"}.get(key, f"'{key}'")
    if fn is None:
        fn = _imported_callable(spec, key)
    at = defined_at(fn) if fn is not None else None
    return f"{what} '{getattr(spec, key)}'" + (f" ({at})" if at else "")


def _imported_callable(spec: Spec, key: str) -> Any:
    given = spec.callable_for(key)
    if given is not None:
        return given
    ref = getattr(spec, key, None)
    if not isinstance(ref, str):
        return None
    module_name, _, attr_path = ref.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in attr_path.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    return obj if callable(obj) else None

