"""What a DeepSpeed engine adds to a finding: which party made the mistake, and the config key.

The engine divides the loss by its config's `gradient_accumulation_steps` in `engine.backward`,
updates (and steps its config's scheduler) only in `engine.step()` at its own accumulation
boundary, and zeroes the gradients itself after the update. So a step count, a scheduler
cadence or a zeroing that is wrong in a DeepSpeed loop has a DeepSpeed-shaped cause: the config
key that disagrees with the K the loop feeds, or a call the loop makes besides the engine's.
"""

from __future__ import annotations

import inspect
import linecache
import re
from dataclasses import dataclass

from ..core import thresholds
from ..core.evidence import Evidence
from ..core.findings import Finding, Location, location
from ..kinds.mismatch import EngineScaleOff, engine_scale_off
from ..probe.events import EngineBuilt
from ..probe.trace import Trace
from ..scan.configs import text_locator
from ..session import Session


@dataclass(frozen=True)
class EngineCause:
    """A DeepSpeed-specific explanation: the sentence, where to point, the fix."""

    sentence: str
    location: Location | None
    fix: str
    config_value: int | None = None


def engine_of(trace: Trace) -> EngineBuilt | None:
    engines = trace.events_of(EngineBuilt)
    return engines[-1] if engines else None


def config_key_location(session: Session, engine: EngineBuilt, key: str) -> Location | None:
    """Where the engine's config sets `key`: its line in the config file the engine was given,
    else the loop's own line that writes the key (a dict built in code), else the
    `deepspeed.initialize` line."""
    if engine.config_file:
        try:
            with open(engine.config_file, encoding="utf-8") as f:
                line = text_locator(f.read())((key,))
        except OSError:
            line = None
        if line is not None:
            return Location(engine.config_file, line, None,
                            linecache.getline(engine.config_file, line).strip())
    pattern = re.compile(rf"[\"']{re.escape(key)}[\"']|\b{re.escape(key)}\s*=")
    try:
        fn = inspect.unwrap(session.code.train_loop)
        file = inspect.getsourcefile(fn)
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        file = None
    if file:
        for offset, text in enumerate(lines):
            if pattern.search(text.split("#", 1)[0]):
                return Location(str(file), start + offset, getattr(fn, "__name__", None),
                                text.strip())
    return location(engine.site)


def extra_steps(session: Session, trace: Trace) -> EngineCause | None:
    """More optimizer steps than windows in a loop that drives a DeepSpeed engine."""
    engine = engine_of(trace)
    K = session.K
    if engine is None:
        return None
    if engine.accumulation_steps != K:
        return EngineCause(
            f"The DeepSpeed config sets gradient_accumulation_steps = "
            f"{engine.accumulation_steps} while the loop feeds K = {K} micro-batches per "
            f"optimizer step: engine.step() updates at the engine's own boundary, every "
            f"{engine.accumulation_steps} micro-batch(es), and engine.backward divides by "
            f"{engine.accumulation_steps}, not {K}.",
            config_key_location(session, engine, "gradient_accumulation_steps"),
            "Make the config's `gradient_accumulation_steps` the K the loop accumulates "
            "(DeepSpeed checks train_batch_size = micro-batch x K x world size), or let the "
            "engine own the count and feed it micro-batches without a K of the loop's own.",
            engine.accumulation_steps)
    return EngineCause(
        "The loop calls an optimizer's step() besides engine.step(): engine.step() already "
        "updates at the accumulation boundary (and is a no-op before it), so every other "
        "step() applies a partial window's gradient.",
        None,
        "Call only engine.step() on every micro-batch; never step the optimizer that "
        "deepspeed.initialize returned (or the one handed to it) yourself.")


def scheduler_cause(trace: Trace, scheduler_type: str) -> str:
    """A sentence for a scheduler that steps too often in a DeepSpeed loop, or ''."""
    engine = engine_of(trace)
    if engine is None:
        return ""
    if engine.scheduler and engine.scheduler == scheduler_type:
        return (f" engine.step() already steps the engine's {scheduler_type} (from the config "
                "or handed to deepspeed.initialize) once per optimizer step: the loop's own "
                "scheduler.step() adds a step on every micro-batch. Remove it.")
    return (" Under DeepSpeed, give the scheduler to deepspeed.initialize (lr_scheduler=...) "
            "or the config's `scheduler`: engine.step() then steps it once per optimizer step.")


def engine_zero_grad_fix(trace: Trace) -> str:
    """The fix of a zeroing inside the window in a DeepSpeed loop ('' elsewhere: the
    catalogue's)."""
    if engine_of(trace) is None:
        return ""
    return ("Remove the loop's engine.zero_grad(): engine.step() clears the gradients itself "
            "after each update, at the engine's accumulation boundary; between micro-batches "
            "the engine must keep them.")


def scale_factor(engine: EngineBuilt | None, ratio: float, cosine: float) -> float | None:
    """The engine's own loss-scale factor (1/S or S) a consumed/reference norm ratio is, for an
    fp16 engine with a scale S > 1 and a gradient pointing the reference's way; None otherwise
    (a ratio of 1/S from a healthy engine is impossible: it unscales what it scaled)."""
    if engine is None or engine.precision != "fp16" or engine.loss_scale <= 1:
        return None
    if not cosine > thresholds.SAME_DIRECTION_COSINE or not ratio > 0:
        return None
    for factor in (1.0 / engine.loss_scale, engine.loss_scale):
        if abs(ratio / factor - 1.0) <= thresholds.ENGINE_SCALE_RTOL:
            return factor
    return None


def engine_update_off(session: Session, trace: Trace, rung: str, step: int, precision: str,
                      ratio: float, cosine: float, tolerance: float,
                      comparison: Evidence) -> Finding | None:
    """A step whose consumed update is the reference's times the DeepSpeed engine's own loss
    scale: the framework's update is not what its config asks for, named at the config key
    that sets the scale (`gradient-mismatch`), not at the loop's loss line; None otherwise."""
    engine = engine_of(trace)
    factor = scale_factor(engine, ratio, cosine)
    if engine is None or factor is None:
        return None
    key = engine.loss_scale_key or "fp16.initial_scale_power"
    return engine_scale_off(EngineScaleOff(
        rung, step, precision, ratio, cosine, engine.loss_scale, factor, key, tolerance,
        comparison, location=config_key_location(session, engine, key.split(".")[-1])))
