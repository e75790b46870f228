"""A run of the user's loop: the `run` settings it is handed, the device, and the call of
`train_loop` (what the loop leaves behind in the process is restored after it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import SpecError
from ..spec import Spec
from .frameworks import reset_framework_state
from .naming import spec_where
from .usercode import UserCode, restore_recursion_limit


@dataclass(frozen=True)
class RunSettings:
    """The read-only `run` handed to `train_loop` (CONTRACT §2)."""

    precision: str
    device: torch.device
    device_type: str
    autocast_dtype: torch.dtype | None
    accumulation_steps: int
    max_grad_norm: float | None
    rank: int = 0
    world_size: int = 1
    micro_batch_size: int | None = None
    optimizer_steps: int = 1


AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str, spec: Spec | None = None) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    where = spec_where(spec, "device") if spec is not None else ""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecError(f"{where}spec key 'device': {name!r} was asked for but this machine has "
                        "no CUDA device; use 'auto' or 'cpu'.")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise SpecError(f"{where}spec key 'device': {name!r} was asked for but this machine has "
                        f"{torch.cuda.device_count()} CUDA device(s).")
    return device



def run_train_loop(code: UserCode, model: Any, optimizer: Any, feed: Any, settings: Any) -> bool:
    """Call the user's train_loop; a generator function (one that yields metrics) runs only
    when iterated, so iterate it to the end. True when it was a generator."""
    import inspect

    from ..core import progress
    from ..core.process_state import LOOP_SCOPE, ProcessState
    from ..probe import frameworks
    from ..probe.patches import Patcher
    progress.run_started(settings.precision, settings.optimizer_steps)
    limit = sys.getrecursionlimit()
    # what the loop leaves behind (autocast entered, grad mode off, a chdir) must not reach
    # the next run or the reference
    kept = ProcessState.take(LOOP_SCOPE)
    reset_framework_state()
    # frameworks the user's module imported are patched for this run (see probe/frameworks.py)
    framework_patches = Patcher()
    frameworks.install(framework_patches)
    try:
        result = code.train_loop(model, optimizer, feed, settings)
        if not inspect.isgenerator(result):
            return False
        for _ in result:
            pass
        return True
    finally:
        framework_patches.undo()
        restore_recursion_limit(limit)
        reset_framework_state()
        code.left_behind.update(kept.restore())
