"""The rung driver's side of observe -> judge -> explain: judge a trace, explain its first bad
step with the rules, and run the extra passes a rule asks for (rules never run the loop)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.findings import Finding, location
from ..judge import Judgement, judge
from ..probe.events import Snapshot
from ..rules import (
    classify_step,
    last_unscale_pair,
    loop_error_finding,
    scheduler_findings,
    step_count_finding,
    update_missing,
)
from ..rules.clip_order import clip_after_step
from ..rules.shapes import Resplit
from ..session import Session, Trace
from . import series

Grads = dict[str, torch.Tensor | None]

__all__ = ["ScriptAmp", "script_amp", "compare_trace", "location", "loop_error_finding",
           "last_unscale_pair", "update_missing", "scheduler_findings", "step_count_finding"]


@dataclass(frozen=True)
class ScriptAmp:
    """A script's own mixed precision as written, before ampdoctor forced it."""

    dtypes: frozenset[str]            # what its enabled autocasts ask for
    scalers: list[dict[str, Any]]     # the GradScalers it enables (`script.forcing` records)


def script_amp(session: Any) -> ScriptAmp | None:
    """What a script's fp32 run recorded of the autocasts and GradScalers the script asked for
    before ampdoctor forced them (an autocast naming no dtype asks for its device's default:
    float16 on CUDA, bfloat16 on the CPU); None for a spec, whose every run is the loop's own
    configuration, switched by `run.precision`."""
    outcome = getattr(session.trace("fp32"), "outcome", None)
    if outcome is None:
        return None
    dtypes = frozenset(a.get("dtype") or (
        "float16" if str(a.get("device")).startswith("cuda") else "bfloat16")
        for a in outcome.autocasts if a.get("enabled"))
    return ScriptAmp(dtypes, [s for s in outcome.scalers if s.get("enabled")])


def compare_trace(session: Session, trace: Trace, rung: str, precision: str,
                  forced_clip: float | None = None) -> tuple[list[Finding], Judgement]:
    """Judge every optimizer step (the judge decides); explain the first bad one (the rules).
    `forced_clip`: the threshold the clip-space rung forced clipping at (rung context the
    findings say)."""
    judgement = judge(session, trace, precision)
    if judgement.weighting is not None:   # every reference from now on is weighted so
        session.adopt_weighting(judgement.weighting)
    series.keep(session, series.run_series(rung, trace, judgement))
    for step, n in judgement.short_over_k[:1]:
        session.notes.add(
            f"step {step} is an epoch's last, short window of {n} of K={session.K} "
            f"micro-batches, its loss divided by K as in the full windows: its update is {n}/"
            f"{session.K} of that window's mean gradient (each micro-batch weighs 1/K, the "
            "usual `loss / K` convention and accelerate's); divide by the window's own count "
            "of micro-batches for its full mean")
    bad = judgement.first_bad
    if bad is None:   # every update matched: a clip after its step never touched the update
        late = clip_after_step(trace, rung, judgement.tolerance.rtol,
                               {s.ordinal: s.metrics.ratio for s in judgement.steps},
                               forced_clip=forced_clip)
        return ([late] if late is not None else []), judgement
    return [classify_step(session, trace, rung, judgement, bad, rerun_for(session),
                          forced_clip)], judgement


def rerun_for(session: Session) -> Resplit:
    """The extra fp32 pass a rule may ask for: the loop on `micro_batches` at accumulation `K`
    from a step's snapshot, unclipped, and the reference of those micro-batches there; the
    first step's consumed gradients and the reference's, or None when the loop could not run
    it."""

    def rerun(micro_batches: list[Any], K: int, snapshot: Snapshot,
              label: str) -> tuple[Grads, Grads] | None:
        no_clip = math.inf if session.spec.max_grad_norm is not None else None
        trace = session.run_loop("fp32", micro_batches=micro_batches, K=K, state=snapshot.state,
                                 training=snapshot.training, max_grad_norm=no_clip)
        if trace.error is not None or not trace.steps:
            return None
        grads: Grads = {}
        for step in trace.steps:
            if step.group == trace.steps[0].group:
                grads.update(step.grads)
        ref = session.reference_for(micro_batches, snapshot.state, snapshot.training,
                                    per_mb=False, label=label)
        return grads, ref.full

    return rerun
