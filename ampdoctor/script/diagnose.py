"""One script-mode diagnose end to end: the runs (`session`), the rungs (`rungs`), the record.

The record is spec mode's (CONTRACT §5) with `"script"`, `"args"` and `"reference_args"` in
place of a spec, and `"found"`: what the runs showed of the script (its models, optimizers,
scaler, autocast, K and micro-batch), said in one line too (`found_text`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import AmpdoctorError, UserCodeError, format_traceback
from ..findings import RungResult
from .session import Command, ScriptSession


def new_record(command: Command) -> dict[str, Any]:
    from ..runner import blank_record, environment
    return blank_record(
        spec=None,
        source={"script": command.script, "args": list(command.args),
                "reference_args": (list(command.reference_args)
                                   if command.reference_args is not None else None)},
        name=os.path.splitext(os.path.basename(command.script))[0], device="unknown",
        accumulation_steps=None, optimizer_steps=command.steps, micro_batch_size=None,
        environment=environment(None))


def _count(n: int) -> str:
    return f"{n:,}"


def found(ss: ScriptSession) -> dict[str, Any]:
    """What the fp32 run showed of the script, as data and as one line."""
    out = ss.trace("fp32").outcome
    models = [{"type": m["type"], "parameters": m["params"],
               "file": m["site"].file if m["site"] else None,
               "line": m["site"].line if m["site"] else None} for m in out.models]
    optimizers = [o["type"] for o in out.optimizers]
    scalers = out.scalers
    autocasts = out.autocasts
    dtypes = sorted({a["dtype"] or "default" for a in autocasts})
    b = ss.spec.micro_batch_size
    parts = []
    if models:
        named = ", ".join(f"{m['type']}, {_count(m['parameters'])} params" for m in models)
        parts.append(f"{len(models)} model{'s' if len(models) > 1 else ''} ({named})")
    else:
        parts.append("no model (no optimizer holds a module's parameters)")
    parts.append(", ".join(optimizers) if optimizers else "no optimizer")
    if scalers:
        parts.append("GradScaler" + ("" if any(s["enabled"] for s in scalers)
                                     else " (disabled by the script's args)"))
    else:
        parts.append("no GradScaler")
    if autocasts:
        off = not any(a["enabled"] for a in autocasts)
        parts.append(f"autocast {'/'.join(_short(d) for d in dtypes)}"
                     + (" (disabled by the script's args)" if off else ""))
    else:
        parts.append("no autocast")
    parts.append(f"K = {ss.K}")
    if b is not None:
        parts.append(f"micro-batch {b}")
    if ss.reference_rows:
        parts.append(f"reference batch {ss.reference_rows}")
    return {"models": models, "optimizers": optimizers,
            "scaler": bool(scalers), "autocast": dtypes if autocasts else None,
            "accumulation_steps": ss.K, "micro_batch_size": b,
            "reference_batch": ss.reference_rows or None,
            "text": "found: " + ", ".join(parts)}


def _short(dtype: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def run_script(command: Command, on_start: Callable[[str], None] | None = None,
               on_done: Callable[[RungResult], None] | None = None) -> dict[str, Any]:
    """Diagnose the script of `command`; the run record. An AmpdoctorError (the script could not
    run at all, a run past its time bound) becomes a record with `error`."""
    from ..runner import fill_record
    from .rungs import run_ladder

    started = time.perf_counter()
    record = new_record(command)
    try:
        ss = ScriptSession(command)
        fp32 = ss.start()
        _check_started(ss, fp32)
        record.update(device=str(ss.device), cuda_available=ss.device.type == "cuda",
                      accumulation_steps=ss.K, micro_batch_size=ss.spec.micro_batch_size)
        record["found"] = found(ss)
        results = run_ladder(ss, on_start, on_done)
    except AmpdoctorError as exc:
        record["error"] = {"type": type(exc).__name__, "message": exc.message,
                           "exit_code": exc.exit_code}
        location = getattr(exc, "location", None)
        if location:
            record["error"]["location"] = {"file": location[0], "line": location[1]}
        if exc.cause is not None:
            record["error"]["traceback"] = format_traceback(exc.cause)
        record["seconds"] = round(time.perf_counter() - started, 3)
        return record
    fill_record(record, results)
    notes = set(ss.notes)
    if ss.unaligned is not None and command.reference_args is not None:
        notes.add(f"the reference (--reference-args) does not read the run's micro-batches: "
                  f"{ss.unaligned}. The rungs that compare updates were not run; make the "
                  "data the same for every batch size (seed it, no shuffling) to compare them")
    if command.reference_args is None:
        notes.add("no --reference-args: the updates were not compared with an fp32 full-batch "
                  "reference. Give the script's arguments for K = 1 and a batch K times the "
                  f"micro-batch (here K = {ss.K}, micro-batch {ss.spec.micro_batch_size})")
    dropout = ss.random_modules()
    if dropout:
        notes.add("dropout was off in every run (" + ", ".join(dropout[:3]) + "): a reference "
                  "over the whole window cannot draw the micro-batches' masks")
    saves = ss.trace("fp32").outcome.saves
    if saves:
        site = saves[0]
        notes.add("the script's torch.save wrote nothing during the triage"
                  + (f" (first at {site.file}:{site.line})" if site else ""))
    record["notes"] = sorted(notes)
    record["runs"] = ss.charts
    record["seconds"] = round(time.perf_counter() - started, 3)
    record["reference_mode"] = "script"
    return record


def _check_started(ss: ScriptSession, fp32: Any) -> None:
    """The fp32 run must have reached an optimizer step of a model ampdoctor found."""
    out = fp32.outcome
    if out.error is not None and not fp32.steps:
        site = out.error.get("site")
        raise UserCodeError(
            f"the script {'exited' if out.ended.startswith('exit') else 'raised'} before its "
            f"first optimizer step: {out.error.get('text')}",
            location=(site.file, site.line) if site is not None else None)
    if not out.optimizers:
        raise UserCodeError(
            f"the script ended ({out.ended}) without building a torch.optim optimizer: "
            "ampdoctor finds the model through the optimizer that holds its parameters")
    if not out.models:
        raise UserCodeError("no torch.nn.Module built by the script holds the parameters of its "
                            "optimizer: ampdoctor cannot tell which model it trains")
    if not fp32.steps:
        raise UserCodeError(
            f"the script ran {len(out.forwards)} forward(s) of its model and "
            f"{out.backward_count} backward(s) but never stepped its optimizer before it "
            f"ended ({out.ended})")
