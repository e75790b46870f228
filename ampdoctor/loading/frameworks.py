"""The process-wide state that training frameworks keep between runs.

HF accelerate keeps its `AcceleratorState`, `PartialState` and `GradientState` as process-wide
singletons: a second `Accelerator(mixed_precision=...)` with another precision raises
"AcceleratorState has already been initialized". Every run of the user's loop (each rung, each
reference pass) starts from a fresh framework state, the way accelerate's own test cases reset
it between tests. Only frameworks the loop already imported are touched; nothing is imported
here.
"""

from __future__ import annotations

import sys


def reset_framework_state() -> list[str]:
    """Forget every known framework singleton; returns the names of those that were reset."""
    reset: list[str] = []
    state = sys.modules.get("accelerate.state")
    if state is not None:
        for name in ("AcceleratorState", "PartialState", "GradientState"):
            cls = getattr(state, name, None)
            shared = getattr(cls, "_shared_state", None)
            if shared:
                shared.clear()
                reset.append(f"accelerate.{name}")
    return reset
