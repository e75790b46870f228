"""Rules for a loop that raised: torch's own refusals mapped to the mistake they name
(`unscale-twice`, an `update()` missing on a skip path), else `loop-error` at the user's line."""

from __future__ import annotations

import os

from ..core.errors import exc_text, format_traceback, safe_repr, safe_str
from ..core.findings import Finding, Location, location
from ..kinds.loop_error import (
    LoopExited,
    LoopRaised,
    UpdateMissing,
    loop_exited,
    loop_raised,
    no_update_before_unscale,
)
from ..kinds.scaling import UnscaleRefused, unscale_refused
from ..probe.events import Backward, Event, OptimizerStep, ScalerStep, Unscale, Update
from ..session import Trace
from .trainer_precision import finding_from_error

#: torch's own refusal of a second unscale_() (matched on a stable fragment): `unscale-twice`.
UNSCALE_TWICE_ERROR = "unscale_() has already been called on this optimizer since the last update()"


def loop_error_finding(trace: Trace, rung: str) -> Finding:
    exc = trace.error
    assert exc is not None
    # the user's exception, quoted: never raising (a __str__ that raises), cut to MESSAGE_LIMIT
    text = exc_text(exc)
    whole = safe_str(exc)
    if "unscale_()" in whole and update_missing(trace):
        steps = trace.events_of(ScalerStep)
        updates = trace.events_of(Update)
        # Point at the update() that exists but was skipped on this path, else at the step.
        site = (updates[-1].site if updates else steps[-1].site if steps else trace.error_site)
        return no_update_before_unscale(UpdateMissing(
            rung, trace.precision, text, len(updates), len(steps), location=location(site)))
    if UNSCALE_TWICE_ERROR in whole:
        refused = [e for e in trace.events_of(Unscale) if e.error is not None]
        site = refused[-1].site if refused else trace.error_site
        earlier = [e for e in trace.events_of(Unscale) if e.error is None
                   and not e.inside_step
                   and (not refused or e.optimizer == refused[-1].optimizer)]
        first = earlier[-1].site if earlier else None
        return unscale_refused(UnscaleRefused(
            rung, trace.precision, text, first=location(first),
            first_is_refused=first is not None and first == site, location=location(site)))
    disagree = finding_from_error(exc, whole, rung)
    if disagree is not None:   # transformers/accelerate refused a Trainer and its DeepSpeed config
        return disagree
    if isinstance(exc, SystemExit):
        return loop_exited(LoopExited(rung, trace.precision, safe_repr(exc.code),
                                      location=location(trace.error_site)))
    finder = trace.finder
    frames = finder.user_sites(exc.__traceback__) if finder is not None else []
    return loop_raised(LoopRaised(
        rung, trace.precision, text,
        frames=tuple(Location(f.file, f.line, f.function) for f in frames),
        clip_given_none=clip_given_none(exc) if trace.settings.max_grad_norm is None else None,
        location=location(trace.error_site), traceback=format_traceback(trace.error)))


#: torch's clipping functions live here (matched on the path's end, any separator)
CLIP_MODULE = ("torch", "nn", "utils", "clip_grad.py")


def clip_given_none(exc: BaseException) -> str | None:
    """The public torch clipping function (`clip_grad_norm_`, `clip_grad_value_`) that raised
    this TypeError over a None threshold (torch 2.x: "float() argument must be ... not
    'NoneType'"), or None when `exc` is something else."""
    if not isinstance(exc, TypeError) or "NoneType" not in safe_str(exc):
        return None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        parts = tuple(os.path.normpath(code.co_filename).split(os.sep)[-len(CLIP_MODULE):])
        if parts == CLIP_MODULE and not code.co_name.startswith("_"):
            return code.co_name
        tb = tb.tb_next
    return None


def last_unscale_pair(trace: Trace) -> tuple[Event, Event, list[Event]] | None:
    """The last unscale_ of the run (outside scaler.step), the one before it on the same
    optimizer, and the events between them; None when there is no such pair."""
    unscales = [e for e in trace.events_of(Unscale) if not e.inside_step]
    if len(unscales) < 2:
        return None
    failing = unscales[-1]
    previous = next((e for e in reversed(unscales[:-1]) if e.optimizer == failing.optimizer),
                    None)
    if previous is None:
        return None
    return previous, failing, [e for e in trace.events if previous.seq < e.seq < failing.seq]


def update_missing(trace: Trace) -> bool:
    """torch refused an unscale_ because the previous window never reached update(): a
    scaler.step with no update after it, or (a hand-written skip path) a previous unscale_ of
    the same optimizer in an earlier window and no update since."""
    last_step = next((e for e in reversed(trace.events) if isinstance(e, ScalerStep)), None)
    if last_step is not None and not any(isinstance(e, Update) and e.seq > last_step.seq
                                         for e in trace.events):
        return True
    pair = last_unscale_pair(trace)
    if pair is None:
        return False
    previous, failing, between = pair
    if any(isinstance(e, Update) for e in between):
        return False
    # The previous unscale_ belongs to an earlier window: that window ended without update()
    # (a skip path that `continue`s). Same window: unscale_ repeated inside it (unscale-twice).
    w_prev, w_fail = trace.window_of_event(previous), trace.window_of_event(failing)
    if w_prev is not None and w_fail is not None:
        return w_prev < w_fail
    # A loop that raised cannot always place events in windows: a full window of backward
    # passes (or a step) between the two calls means a new window began.
    backwards_between = sum(1 for e in between if isinstance(e, Backward))
    return (backwards_between >= max(trace.accumulation_steps, 2)
            or any(isinstance(e, (ScalerStep, OptimizerStep)) for e in between))
