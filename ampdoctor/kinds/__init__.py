"""The diagnosis kinds, each one unit (a module per kind or small family of kinds under
`ampdoctor/kinds/`): its catalogue text, the measured consequence that makes it an error, what
its `evidence.measured` counts, its fix in a framework's terms and its one decider, the only
function that builds a `Finding` of it (tests/test_rules_table.py checks that by reading the
source). A kind with a typed observation of its own (`ScheduleOnSkips`, ...) also decides its
severity and words its message, fix and evidence there, from the numbers a rule or rung measured.

This package assembles them: `KINDS` (in the order `ampdoctor explain` lists them), `CATALOGUE`
by name, the rule table `RULES` (`explain --list --json` prints its `decided_in`), `ERROR_WHEN`
(docs/kinds.md repeats it under each kind) and `decide` for an observation that names its kind
as data.

This package must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..core.findings import Finding, Location
from . import (
    accumulation,
    baseline,
    clipping,
    double_scaling,
    frequent_skips,
    loop_error,
    mismatch,
    precision,
    reduction,
    scaling,
    schedule,
    skips,
    stepping,
    sync,
)
from .base import Kind, Observed, Rule

__all__ = ["Kind", "Rule", "Observed", "KINDS", "CATALOGUE", "RULES", "ERROR_WHEN",
           "FRAMEWORK_FIXES", "DECIDERS", "decide", "from_dict"]

#: Every diagnosis kind, in the order `ampdoctor explain` lists them.
KINDS: tuple[Kind, ...] = (
    baseline.NONDETERMINISTIC_BASELINE,
    accumulation.MISSING_ACCUMULATION_AVERAGE,
    accumulation.DOUBLE_AVERAGE,
    reduction.REDUCTION_MISMATCH,
    reduction.WEIGHTED_AVERAGE_MISMATCH,
    stepping.STEP_PER_MICROBATCH,
    stepping.ZERO_GRAD_INSIDE_ACCUMULATION,
    sync.MISSING_NO_SYNC,
    precision.HALF_OPEN_AMP,
    clipping.CLIP_BEFORE_UNSCALE,
    scaling.MISSING_UNSCALE,
    scaling.UNSCALE_TWICE,
    scaling.UPDATE_PER_MICROBATCH,
    double_scaling.DOUBLE_SCALING,
    schedule.SCHEDULER_PER_MICROBATCH,
    schedule.SCHEDULER_STEPS_ON_SKIP,
    skips.NO_ZERO_GRAD_AFTER_SKIP,
    stepping.MISSING_ZERO_GRAD,
    frequent_skips.FREQUENT_SKIPS,
    mismatch.GRADIENT_MISMATCH,
    loop_error.LOOP_ERROR,
)

CATALOGUE: dict[str, Kind] = {k.name: k for k in KINDS}

#: kind -> rule, the way ruff keeps one code -> rule table: what the kind's `evidence.measured`
#: counts and its one decider (grep the decider's name for the paths that reach the kind).
RULES: dict[str, Rule] = {k.name: Rule(k.name, k.measured, k.decided_in) for k in KINDS}

#: kind -> the measured consequence that makes a finding of it an `error`. The rule of every
#: kind: only a measured consequence is an error -- the consumed update, or the LR / loss-scale
#: trajectory, or the communication volume where a rung judges those, differs from the
#: reference; a call pattern whose update matched is at most a warning.
ERROR_WHEN: dict[str, str] = {k.name: k.error_when for k in KINDS}

#: (kind, framework) -> the kind's fix in that framework's terms.
FRAMEWORK_FIXES: dict[tuple[str, str], str] = {
    (k.name, framework): fix for k in KINDS for framework, fix in k.framework_fixes.items()}


def _decider(kind: Kind) -> Callable[[Observed], Finding]:
    module, _, function = kind.decided_in.partition(":")
    decider: Callable[[Observed], Finding] = getattr(sys.modules[module], function)
    return decider


#: kind -> its decider, for the observations that carry a kind as data.
DECIDERS: dict[str, Callable[[Observed], Finding]] = {k.name: _decider(k) for k in KINDS}


def decide(kind: str, seen: Observed) -> Finding:
    """The finding of `kind` for an observation that names its kind as data (a hypothesis that
    matched, a violation of the step state machine, a rank's finding sent over a pipe)."""
    decider = DECIDERS.get(kind)
    if decider is None:
        raise ValueError(f"unknown finding kind {kind!r}")
    return decider(seen)


def from_dict(data: dict[str, Any]) -> Finding:
    """A finding another process decided and sent as `Finding.to_dict()`, rebuilt by the
    decider of its kind."""
    data = dict(data)
    kind = data.pop("kind")
    if isinstance(data.get("location"), dict):
        data["location"] = Location(**data["location"])
    return decide(kind, Observed(**data))
