"""The deciders of the kinds, by their old names: each kind's one decider now stands in its unit
under `ampdoctor/kinds/` (`kinds.RULES[kind].decided_in`); this module re-exports them for the
rules and rungs that still hand a kind a generic `Observed`.

This module must not import torch: the static scan runs without it.
"""

from __future__ import annotations

from .kinds import DECIDERS, Observed, decide, from_dict
from .kinds.accumulation import (
                                 double_average,
                                 missing_accumulation_average,
)
from .kinds.base import FORCED_FP16, skip_severity
from .kinds.baseline import nondeterministic_baseline
from .kinds.clipping import clip_before_unscale
from .kinds.double_scaling import double_scaling
from .kinds.frequent_skips import frequent_skips
from .kinds.loop_error import loop_error
from .kinds.mismatch import gradient_mismatch
from .kinds.precision import half_open_amp
from .kinds.reduction import reduction_mismatch, weighted_average_mismatch
from .kinds.scaling import missing_unscale, unscale_twice, update_per_microbatch
from .kinds.schedule import (
                                 ScheduleOnSkips,
                                 schedule_on_skips,
                                 scheduler_per_microbatch,
                                 scheduler_steps_on_skip,
)
from .kinds.skips import no_zero_grad_after_skip
from .kinds.stepping import missing_zero_grad, step_per_microbatch, zero_grad_inside_accumulation
from .kinds.sync import missing_no_sync, sync_on_every_micro_batch

__all__ = ["DECIDERS", "FORCED_FP16", "Observed", "ScheduleOnSkips", "clip_before_unscale",
           "decide", "double_average", "double_scaling", "frequent_skips", "from_dict",
           "gradient_mismatch", "half_open_amp", "loop_error", "missing_accumulation_average",
           "missing_no_sync", "missing_unscale", "missing_zero_grad", "no_zero_grad_after_skip",
           "nondeterministic_baseline", "reduction_mismatch", "schedule_on_skips",
           "scheduler_per_microbatch", "scheduler_steps_on_skip", "skip_severity",
           "step_per_microbatch", "sync_on_every_micro_batch", "unscale_twice",
           "update_per_microbatch", "weighted_average_mismatch",
           "zero_grad_inside_accumulation"]
