"""The rung driver's side of observe -> judge -> explain: judge a trace, explain its first bad
step with the rules, and run the extra passes a rule asks for (rules never run the loop)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..findings import Finding, location
from ..judge import Judgement, judge
from ..rules import (classify_step, last_unscale_pair, loop_error_finding, scheduler_findings,
                     step_count_finding, update_missing)
from ..session import Session, Trace
from . import series

__all__ = ["compare_trace", "location", "loop_error_finding", "last_unscale_pair",
           "update_missing", "scheduler_findings", "step_count_finding"]


def compare_trace(session: Session, trace: Trace, rung: str,
                  precision: str) -> tuple[list[Finding], Judgement]:
    """Judge every optimizer step (the judge decides); explain the first bad one (the rules)."""
    judgement = judge(session, trace, precision)
    series.keep(session, series.run_series(rung, trace, judgement))
    bad = judgement.first_bad
    if bad is None:
        return [], judgement
    return [classify_step(session, trace, rung, judgement, bad, rerun_for(session))], judgement


def rerun_for(session: Session):
    """The extra fp32 pass a rule may ask for: the loop on `micro_batches` at accumulation `K`
    from a step's snapshot, unclipped; the first step's consumed gradients, or None."""

    def rerun(micro_batches: list[Any], K: int, snapshot) -> dict[str, torch.Tensor | None] | None:
        no_clip = math.inf if session.spec.max_grad_norm is not None else None
        trace = session.run_loop("fp32", micro_batches=micro_batches, K=K, state=snapshot.state,
                                 training=snapshot.training, max_grad_norm=no_clip)
        if trace.error is not None or not trace.steps:
            return None
        grads: dict[str, torch.Tensor | None] = {}
        for step in trace.steps:
            if step.group == trace.steps[0].group:
                grads.update(step.grads)
        return grads

    return rerun
