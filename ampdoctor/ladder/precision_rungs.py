"""The rungs after fp32-accum, imported lazily (each pulls in its own machinery)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.findings import RungResult
from ..probe.events import ScalerInit

if TYPE_CHECKING:
    from ..rules.scaler_ownership import Ownership
    from ..session import Session


def run_bf16(session: Session) -> RungResult:
    from .amp import run_bf16 as run
    return run(session)


def run_fp16(session: Session) -> RungResult:
    from .amp import run_fp16 as run
    return run(session)


def run_double_scaling(session: Any) -> RungResult:
    # session: a Session or a script's ScriptSession (duck-typed)
    from .double_scaling import evaluate
    runtime_owner = None
    trace = session.traces.get("fp16")
    if trace is not None:
        inits = [e for e in trace.events_of(ScalerInit) if e.enabled and e.site]
        if inits:
            runtime_owner = {"kind": "GradScaler", "file": inits[0].site.file,
                             "line": inits[0].site.line}
    traces = list(session.traces.values())
    constructed = {(e.site.file, e.site.line) for t in traces
                   for e in t.events_of(ScalerInit) if e.site} if traces else None
    # the files the runs executed: a step function imported from a helper module is on the
    # loop's path, and a GradScaler there that no run built is dormant as in the loop's own files
    executed = sorted({e.site.file for t in traces for e in t.events if e.site})
    return evaluate(session.spec.scan_paths(), runtime_owner, session.code.source_files(),
                    constructed, _ownership(session), executed)


def _ownership(session: Any) -> Ownership | None:
    """What the run with enabled GradScalers (the fp16 one first) saw them do, or None."""
    from ..rules.scaler_ownership import ownership

    for name in ["fp16", *(n for n in session.traces if n != "fp16")]:
        trace = session.traces.get(name)
        if trace is not None and any(e.enabled for e in trace.events_of(ScalerInit)):
            return ownership(trace.events, trace.parameter_owners())
    return None


def run_clip_space(session: Session) -> RungResult:
    from .clip_space import run
    return run(session)


def run_skips(session: Session) -> RungResult:
    from .skips import run
    return run(session)


def run_ddp(session: Session) -> RungResult:
    from .ddp_sync import run
    return run(session)
