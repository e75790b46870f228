"""The loop cast the model's weights to fp16/bf16 (`model.half()` in train_loop): a
`half-open-amp` error in any rung that runs the loop.

ampdoctor hands the loop fp32 weights. A loop that casts them itself trains reduced-precision
weights with no fp32 master copy: in the fp32 run the "fp32" baseline is not fp32 (and the
loop-as-reference, the same loop, is cast too, so its updates would match and prove nothing);
in an fp16 run GradScaler refuses to unscale fp16 gradients. Always an error: nothing the run
computed is what mixed precision with fp32 master weights computes.
"""

from __future__ import annotations

import inspect
import re

from ..core.errors import exc_text
from ..core.findings import Finding, Location, location
from ..kinds.precision import WeightsCast, weights_cast
from ..probe.events import EngineBuilt
from ..session import Session, Trace

#: A loop line that casts the model (where the cast is pointed at when no Module method did it).
CAST_TEXT = re.compile(r"\.(half|bfloat16)\(\)|\.to\([^)]*(float16|bfloat16|half)|"
                       r"\.data\s*=.*(half|bfloat16|float16)")


def loop_location(session: Session, pattern: re.Pattern | None = None) -> Location | None:
    """The loop's first line that matches `pattern` (the cast, or an autocast the loop sets up
    and never enters), else the loop's `def` line; None when its source cannot be read."""
    try:
        fn = inspect.unwrap(session.code.train_loop)
        file = inspect.getsourcefile(fn)
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    if not file:
        return None
    name = getattr(fn, "__name__", None)
    if pattern is not None:
        for offset, text in enumerate(lines):
            if pattern.search(text.split("#", 1)[0]):
                return Location(str(file), start + offset, name, text.strip())
    return Location(str(file), start, name, None)


def weight_cast_finding(session: Session, trace: Trace, rung: str) -> Finding | None:
    cast = trace.cast
    if cast is None or engine_precision(trace) is not None:
        return None   # (an engine's own cast, over its fp32 masters: mixed precision as designed)
    return weights_cast(WeightsCast(
        rung, trace.precision, tuple(cast.dtypes), tuple(cast.names), cast.parameters,
        loop_is_reference=session.code.loss is None,
        error=exc_text(trace.error, 300) if trace.error is not None else None,
        location=location(cast.site) or loop_location(session, CAST_TEXT)))


def engine_precision(trace: Trace) -> str | None:
    """The precision a framework engine ran the loop's model in by its own design -- DeepSpeed
    casts the module to bf16/fp16 and steps fp32 master copies in its optimizer, with no
    autocast -- or None when no such engine trained this run."""
    for event in trace.events_of(EngineBuilt):
        if event.fp32_master:
            return event.precision
    return None
