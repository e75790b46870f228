"""Explain (DESIGN §3a): rules look at the judge's numbers and the probe's events and say which
known shape a mismatch has, at which call site. The table of kinds -> rule modules is
`findings.RULES` (`ampdoctor explain KIND` prints it).

- `accumulation`: the hypotheses for a bad step (K, 1/K, b, zero_grad inside, weighting, S, 1/S)
- `shapes`: a clip in scaled space, a varying divisor, carried-over gradients, a summed count
- `sites`: the line of a hand-written division or clip
- `loop_errors`: torch's refusals mapped to their kinds, else `loop-error`
- `schedule`: the LR each optimizer step used against the schedule
- `counts`: more optimizer steps than windows, steps off the window boundaries
- `unaveraged`: a window summed without / K while its weighting differs too
- `skip_rate`: how often the plain fp16 run skipped, before and after its first update
"""

from .accumulation import classify_step
from .counts import step_count_finding
from .loop_errors import last_unscale_pair, loop_error_finding, update_missing
from .schedule import scheduler_findings

__all__ = ["classify_step", "step_count_finding", "last_unscale_pair", "loop_error_finding",
           "update_missing", "scheduler_findings"]
