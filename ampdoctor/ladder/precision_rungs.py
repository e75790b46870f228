"""Rungs after fp32-accum. Placeholders until their issues land: each skips with its reason."""

from __future__ import annotations

from ..findings import RungResult


def _pending(rung: str, why: str) -> RungResult:
    return RungResult(rung, "skip", why)


def run_bf16(session) -> RungResult:
    from .amp import run_bf16 as run
    return run(session)


def run_fp16(session) -> RungResult:
    from .amp import run_fp16 as run
    return run(session)


def run_double_scaling(session) -> RungResult:
    return _pending("double-scaling", "not implemented in this version")


def run_clip_space(session) -> RungResult:
    return _pending("clip-space", "not implemented in this version")


def run_skips(session) -> RungResult:
    return _pending("skips", "not implemented in this version")


def run_ddp(session) -> RungResult:
    if session.spec.ddp is None:
        return RungResult("ddp-sync", "skip", "no `ddp` in the spec")
    return _pending("ddp-sync", "the DDP rung is not implemented in this version")
