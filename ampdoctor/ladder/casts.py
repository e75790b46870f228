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

from .. import deciders
from ..deciders import Observed
from ..enums import Severity
from ..errors import exc_text
from ..findings import Finding, Location, location
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
    dtype = cast.dtypes[0].removeprefix("torch.")
    names = ", ".join(f"`{n}`" for n in cast.names[:3])
    more = len(cast.names) - 3
    names += f" and {more} more" if more > 0 else ""
    where = location(cast.site) or loop_location(session, CAST_TEXT)
    code = (where.code or "").split("#", 1)[0].strip() if where is not None else ""
    call = f" (`{code}`, line {where.line})" if code and where is not None else ""
    if trace.precision == "fp32":
        consequence = f"its 'fp32' baseline is really {dtype}"
        if session.code.loss is None:
            consequence += (" (and the loop-as-reference, the same loop, is cast too: its "
                            "updates would match and prove nothing)")
    else:
        consequence = (f"the {trace.precision} run trains {dtype} weights, not fp32 weights "
                       f"under autocast({'bfloat16' if trace.precision == 'bf16' else 'float16'})")
    fp16 = (" GradScaler refuses to unscale fp16 gradients, and small updates round away in "
            "fp16 weights." if "torch.float16" in cast.dtypes else
            " Small updates round away in low-precision weights.")
    error = (f" The loop then raised {exc_text(trace.error, 300).rstrip('.')}."
             if trace.error is not None else "")
    return deciders.half_open_amp(Observed(rung, Severity.ERROR,
        f"The {trace.precision} run cast the model's weights to {dtype}{call}: "
        f"{len(cast.names)} of {cast.parameters} trainable parameter tensor(s) ({names}) were "
        f"{dtype} when the loop returned, so the optimizer updates {dtype} weights with no fp32 "
        f"master "
        f"copy and {consequence}.{fp16}{error} Keep the model in fp32 and let autocast make the "
        "low-precision compute: `with torch.autocast(run.device_type, "
        "dtype=run.autocast_dtype, enabled=run.autocast_dtype is not None):`.",
        evidence={"measured": ", ".join(d.removeprefix("torch.") for d in cast.dtypes),
                  "expected": "float32", "parameters_cast": len(cast.names),
                  "parameters": cast.parameters, "cast": list(cast.names[:10]),
                  "precision": trace.precision},
        location=where))


def engine_precision(trace: Trace) -> str | None:
    """The precision a framework engine ran the loop's model in by its own design -- DeepSpeed
    casts the module to bf16/fp16 and steps fp32 master copies in its optimizer, with no
    autocast -- or None when no such engine trained this run."""
    for event in trace.events_of(EngineBuilt):
        if event.fp32_master:
            return event.precision
    return None
