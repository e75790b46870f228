"""ampdoctor: triage for gradient accumulation combined with mixed precision.

The Python API (`diagnose`, `assert_healthy`, `Spec`, `Record`) is imported on first use, so
`import ampdoctor` (and `ampdoctor --help`) stays fast and does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = ["diagnose", "assert_healthy", "load", "Spec", "Record", "Unhealthy", "SpecError",
           "UserCodeError", "watch", "Watch", "WatchError", "watch_accelerate", "WatchCallback",
           "__version__"]

if TYPE_CHECKING:
    from .api import Record, Unhealthy, assert_healthy, diagnose, load
    from .core.errors import SpecError, UserCodeError
    from .sentinel import Watch, WatchError, watch
    from .sentinel.accel import watch_accelerate
    from .sentinel.hf import WatchCallback
    from .spec import Spec

_LAZY = {"diagnose": "api", "assert_healthy": "api", "load": "api", "Record": "api",
         "Unhealthy": "api", "Spec": "spec", "SpecError": "core.errors",
         "UserCodeError": "core.errors",
         "watch": "sentinel", "Watch": "sentinel", "WatchError": "sentinel",
         # the framework callbacks: transformers is imported only when WatchCallback is asked
         "watch_accelerate": "sentinel.accel", "WatchCallback": "sentinel.hf"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
