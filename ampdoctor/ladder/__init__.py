"""The ladder (CONTRACT §3): rungs in order; the first that fails stops the ladder, unless
the spec's `keep_going` (`--keep-going`) asks for every rung: then each rung after the first
failure runs and is marked `after_failure` (its summary says so too).

Each rung is `run(session) -> RungResult`. "Stop at the first failure" lives here only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..core import progress
from ..core.enums import RungId, Status
from ..core.findings import RUNG_IDS, RungResult
from .deadline import RungTimeout, deadline, timeout_result


def _rungs() -> dict[str, Callable]:
    from . import fp32_accum, precision_rungs, reproducibility
    return {
        "reproducibility": reproducibility.run,
        "fp32-accum": fp32_accum.run,
        "bf16-no-scaler": precision_rungs.run_bf16,
        "fp16-scaler": precision_rungs.run_fp16,
        "double-scaling": precision_rungs.run_double_scaling,
        "clip-space": precision_rungs.run_clip_space,
        "skips": precision_rungs.run_skips,
        "ddp-sync": precision_rungs.run_ddp,
    }


def rung_weights(spec: Any) -> dict[str, float]:
    # spec: a Spec or a script's ScriptSpec (duck-typed)
    """Each rung's expected cost relative to the others, for the progress line's estimate of
    the time left (measured on the sample specs: reproducibility runs the loop twice and
    builds the fp32 references the later rungs reuse, about 70 % of a diagnose; clip-space and
    skips share one fp16 pass when the loop clips; ddp-sync starts processes)."""
    clips = getattr(spec, "max_grad_norm", None) is not None
    return {"reproducibility": 8.0, "fp32-accum": 0.2, "bf16-no-scaler": 1.0,
            "fp16-scaler": 1.0, "double-scaling": 0.1,
            "clip-space": 0.9 if clips else 0.05, "skips": 0.05 if clips else 0.7,
            "ddp-sync": 10.0 if getattr(spec, "ddp", None) is not None else 0.05}

#: The precision a rung runs the loop in (fp32 rungs always run). clip-space and skips are
#: about the fp16 loss scale: without fp16 there is no scaled space and nothing to skip.
RUNG_PRECISION = {"bf16-no-scaler": "bf16", "fp16-scaler": "fp16", "clip-space": "fp16",
                  "skips": "fp16"}


def skipped(session: Any, rung_id: RungId) -> RungResult | None:
    # session: a Session or a script's ScriptSession (duck-typed)
    """The skip of a rung the spec leaves out (`rungs`, or a precision it does not use)."""
    wanted = RUNG_PRECISION.get(rung_id)
    chosen = session.spec.rungs
    if chosen is not None and rung_id not in chosen:
        return RungResult(rung_id, Status.SKIP, f"not among the rungs asked for "
                          f"({', '.join(chosen)})")
    if wanted is not None and wanted not in session.spec.precisions:
        # a script has no spec: its precisions come from --precisions
        given = "--precisions" if getattr(session.spec, "script", None) else "the spec's precisions"
        return RungResult(rung_id, Status.SKIP, f"{wanted} is not in {given} "
                          f"({', '.join(session.spec.precisions)}): this training does "
                          f"not use it")
    return None


def run_ladder(session: Any, on_start: Callable[[str], None] | None = None,
               on_done: Callable[[RungResult], None] | None = None,
               rungs: dict[str, Callable[..., RungResult]] | None = None,
               weights: dict[str, float] | None = None) -> list[RungResult]:
    """Every rung in order on `session`, the one driver of every run source: a spec's loop or
    framework entry point (the rungs of this package), or a script (`rungs`: script mode's
    table, whose runs each bound themselves, so no rung deadline here). `weights`: each
    rung's expected cost relative to the others, for the progress estimate."""
    own_bounds = rungs is not None
    rungs = rungs if rungs is not None else _rungs()
    from ..judge import StepJudge
    from ..probe.feed import FORWARDS
    # the runs a rung judges are judged step by step as they happen (where they can be)
    session.step_observer_for = StepJudge
    results: list[RungResult] = []
    failed = False
    keep_going = bool(getattr(session.spec, "keep_going", False))
    progress.plan([r for r in RUNG_IDS if skipped(session, r) is None],
                  weights if weights is not None else rung_weights(session.spec))
    for rung_id in RUNG_IDS:
        if failed and not keep_going:
            results.append(RungResult(rung_id, Status.NOT_RUN, "an earlier rung failed"))
            continue
        unselected = skipped(session, rung_id)
        if unselected is not None:
            result = unselected
        else:
            if on_start:
                on_start(rung_id)
            started = time.perf_counter()
            passes = dict(FORWARDS)
            try:
                # ddp-sync bounds its own processes (ddp.timeout_s); a script's runs, theirs
                with deadline(None if rung_id == "ddp-sync" or own_bounds
                              else session.spec.timeout_s):
                    result = rungs[rung_id](session)
            except RungTimeout as exc:
                result = timeout_result(rung_id, session, exc)
            result = replace(result, seconds=time.perf_counter() - started)
            if os.environ.get("AMPDOCTOR_COUNT_PASSES"):
                result.details["passes"] = {k: FORWARDS[k] - passes[k] for k in FORWARDS}
                import torch
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    result.details["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
            session.rung_done(rung_id)
        if failed:
            result = after_failure(result)
        results.append(result)
        if on_done:
            on_done(result)
        failed = failed or result.status == "fail"
    return results


def after_failure(result: RungResult) -> RungResult:
    """A rung run (or skipped) after an earlier one failed, under keep_going: marked, so a
    reader knows what it ran on (a loop already known to be wrong)."""
    details = dict(result.details, after_failure=True)
    summary = f"after a failure: {result.summary}" if result.summary else "after a failure"
    return replace(result, summary=summary, details=details)
