"""The rungs after fp32-accum, imported lazily (each pulls in its own machinery)."""

from __future__ import annotations

from ..findings import RungResult
from ..probe.events import ScalerInit


def run_bf16(session) -> RungResult:
    from .amp import run_bf16 as run
    return run(session)


def run_fp16(session) -> RungResult:
    from .amp import run_fp16 as run
    return run(session)


def run_double_scaling(session) -> RungResult:
    from .double_scaling import evaluate
    runtime_owner = None
    trace = session.traces.get("fp16")
    if trace is not None:
        inits = [e for e in trace.events_of(ScalerInit) if e.enabled and e.site]
        if inits:
            runtime_owner = {"kind": "GradScaler", "file": inits[0].site.file,
                             "line": inits[0].site.line}
    constructed = {(e.site.file, e.site.line) for t in session.traces.values()
                   for e in t.events_of(ScalerInit) if e.site}
    # the files the runs executed: a step function imported from a helper module is on the
    # loop's path, and a GradScaler there that no run built is dormant as in the loop's own files
    executed = sorted({e.site.file for t in session.traces.values() for e in t.events if e.site})
    return evaluate(session.spec.scan_paths(), runtime_owner, session.code.source_files(),
                    constructed, executed)


def run_clip_space(session) -> RungResult:
    from .clip_space import run
    return run(session)


def run_skips(session) -> RungResult:
    from .skips import run
    return run(session)


def run_ddp(session) -> RungResult:
    from .ddp_sync import run
    return run(session)
