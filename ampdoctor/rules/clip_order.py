"""A clip that runs after the optimizer step that consumed its gradients.

`clip_grad_norm_` changes `.grad` in place; the optimizer reads `.grad` when it steps. A clip
placed after `optimizer.step()` / `scaler.step()` (and before the next backward) therefore
rescales gradients that were already used and are about to be cleared: the update was never
clipped. The clip itself measured the consequence -- the norm it saw is the norm of the
gradient the step consumed -- so when that norm is above its threshold by more than the rung's
tolerance, the update is `norm / max_norm` times the clipped one the loop meant: an error. A
clip after the step that does not bite changes nothing (a logging idiom such as
`clip_grad_norm_(params, inf)` after the step is common) and is not reported.

Only clips whose parameters all belong to optimizers that stepped since the last backward
count: a GAN that steps the discriminator, then clips and steps the generator, is healthy.
"""

from __future__ import annotations

import math

from ..core.findings import Finding, location
from ..kinds.mismatch import ClipAfterStep
from ..kinds.mismatch import clip_after_step as clip_after_step_finding
from ..probe.events import Backward, Clip, OptimizerStep
from ..session import Trace


def clip_after_step(trace: Trace, rung: str, rtol: float,
                    judged: dict[int, float] | None = None,
                    forced_clip: float | None = None) -> Finding | None:
    """The first clip after a step that would have changed that step's update, or None.
    `judged` maps a step's ordinal to its judged update/reference norm ratio (the number the
    report's chart plots for it: about 1, the update matched the unclipped reference)."""
    owners = trace.parameter_owners()
    stepped: set[int] = set()          # optimizer slots stepped since the last backward
    steps_seen = 0
    for event in trace.events:
        if isinstance(event, Backward):
            stepped.clear()
        elif isinstance(event, OptimizerStep):
            steps_seen += 1
            if event.optimizer is not None:
                stepped.add(event.optimizer)
        elif isinstance(event, Clip) and stepped and _bites(event, rtol):
            slots = {owners.get(pid) for pid in event.param_ids}
            if slots and None not in slots and slots <= stepped:
                step = steps_seen - 1
                return _finding(event, rung, step, rtol, (judged or {}).get(step), forced_clip)
    return None


def _bites(clip: Clip, rtol: float) -> bool:
    if clip.clip_kind != "norm" or clip.max_norm is None or clip.total_norm is None:
        return False
    if not (math.isfinite(clip.max_norm) and clip.max_norm > 0 and math.isfinite(clip.total_norm)):
        return False
    return clip.total_norm / clip.max_norm - 1.0 > rtol


def _finding(clip: Clip, rung: str, step: int, rtol: float, ratio: float | None,
             forced_clip: float | None = None) -> Finding:
    assert clip.max_norm is not None and clip.total_norm is not None
    return clip_after_step_finding(ClipAfterStep(
        rung, step, clip.total_norm, clip.max_norm, rtol, ratio, forced_clip=forced_clip,
        location=location(clip.site)))
