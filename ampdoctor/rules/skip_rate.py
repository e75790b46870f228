"""Rule `frequent-skips`: how often the plain fp16 run's GradScaler skipped its update, judged
in two phases.

Until its first real update the scaler is settling on a scale: it starts at `init_scale` and
backs off on every overflow, so leading skips are normal at the start of training (a slow
search -- a timid backoff_factor -- or a run too short to finish it is worth a warning). After
its first real update the scaler has found a scale that works, and every further skip drops an
update the fp32 reference makes: more of them than the threshold is an error (a growth_factor
or growth_interval that grows the scale into overflow again and again).

All of that assumes one loss-scale state machine that lives as long as the training: a
GradScaler built anew for every optimizer step (inside a `train_step`) restarts from
`init_scale` each time, so a backoff never lasts -- an overflow at the initial scale recurs on
every step -- and the scale never grows. `scale_reset` reads that from the scale trajectory
itself: the scale a replacing scaler started from differs from the one the scaler it replaced
had reached (a restored `load_state_dict` carries it, and is no reset)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core import thresholds
from ..core.findings import Finding, location
from ..kinds.frequent_skips import ScaleReset, SkipTrajectory, skip_trajectory
from ..kinds.frequent_skips import scale_reset as scale_reset_finding
from ..probe.events import Scale, ScalerInit, ScalerStep, Unscale, Update
from ..session import Trace


def _skips(plain: Trace, rung: str, own_scaler: bool) -> SkipTrajectory:
    steps = plain.events_of(ScalerStep)
    updates = plain.events_of(Update)
    flags = [bool(e.skipped) for e in steps]
    # Leading skips are the scaler searching down from init_scale: normal at the start of
    # training. What counts is skipping once it has found a scale that works, or never finding
    # one within the run.
    first_ok = flags.index(False) if False in flags else len(flags)
    # A skip right after the scale grew is the scaler growing into overflow: once per
    # growth_interval in steady state, so one such skip already says "frequent" when that
    # interval is short.
    grew_into_overflow = any(
        flag and i > 0 and _grew(updates[i - 1].scale_before, updates[i].scale_before)
        for i, flag in enumerate(flags[:len(updates)]))
    inits = [e for e in plain.events_of(ScalerInit) if e.enabled]
    skipped = [e for e in steps if e.skipped]
    site = inits[0].site if inits else (skipped[0].site if skipped else None)
    return SkipTrajectory(
        rung, tuple(flags), tuple(e.scale_after for e in updates if e.scale_after is not None),
        first_ok, first_ok - _search_skips(first_ok, updates),
        inits[0].growth_interval if inits else None, inits[0].growth_factor if inits else None,
        grew_into_overflow, own_scaler=own_scaler, location=location(site))


def _search_skips(first_ok: int, updates: list[Update]) -> int:
    """The leading skips a search needed: it halves the scale per skip (the default backoff
    0.5), so it may take as many skips as halvings between init_scale and the scale that
    worked. Skips beyond that (a timid backoff_factor such as 0.9) are slow searching, and
    count."""
    if 0 < first_ok < len(updates):
        init = updates[0].scale_before
        found = updates[first_ok].scale_before
        if init and found and 0 < found <= init:
            return min(first_ok, math.ceil(math.log2(init / found)
                                           - thresholds.SEARCH_HALVINGS_SLACK))
    return first_ok


def frequent_skips(plain: Trace, rung: str, own_scaler: bool = True) -> Finding | None:
    """The finding for the plain fp16 run's skips, or None when they are what GradScaler
    costs anyway (the unit `kinds.frequent_skips.skip_trajectory` decides)."""
    return skip_trajectory(_skips(plain, rung, own_scaler))


def _grew(before: float | None, after: float | None) -> bool:
    """The scale grew from one update to the next (both known and non-zero)."""
    return bool(after and before and after > before)


_SCALER_CALLS = (Scale, Unscale, ScalerStep, Update)


@dataclass(frozen=True)
class Reset:
    """A GradScaler that took the place of another one mid-run without its scale."""

    init: ScalerInit        # the replacing scaler's construction
    reached: float          # the scale the replaced scaler's last update left
    restarted: float        # the scale the replacing scaler's first update started from


def scale_resets(trace: Trace) -> list[Reset]:
    """Each enabled GradScaler built after another one had updated, when the older one is never
    called again (replaced, not a second live scaler such as a GAN's) and the new one's first
    update starts from another scale than the old one's last update left."""
    calls = [e for e in trace.events if isinstance(e, _SCALER_CALLS)]
    updates = trace.events_of(Update)
    resets: list[Reset] = []
    for init in trace.events_of(ScalerInit):
        if not init.enabled:
            continue
        earlier = [u for u in updates if u.seq < init.seq and u.scaler != init.scaler
                   and u.scale_after]
        first = next((u for u in updates if u.seq > init.seq and u.scaler == init.scaler
                      and u.scale_before), None)
        if not earlier or first is None:
            continue
        old = earlier[-1]
        if any(e.scaler == old.scaler and e.seq > init.seq for e in calls):
            continue   # the older scaler lives on beside it
        assert old.scale_after is not None and first.scale_before is not None
        if not math.isclose(first.scale_before, old.scale_after, rel_tol=1e-6):
            resets.append(Reset(init, old.scale_after, first.scale_before))
    return resets


def scale_reset(traces: list[tuple[str, Trace]], rung: str,
                own_scaler: bool = True) -> Finding | None:
    """The finding for a loss-scale state machine restarted mid-run (module docstring), from
    the first of `traces` (label, trace) that shows it. Its consequence is measured in the
    scale trajectory the skips rung judges (a backoff undone, so an overflow at the initial
    scale never stops): an error in a run whose own precision uses a GradScaler."""
    found = next(((label, trace, resets) for label, trace in traces
                  if (resets := scale_resets(trace))), None)
    if found is None:
        return None
    label, trace, resets = found
    first = resets[0]
    built = sum(1 for e in trace.events_of(ScalerInit) if e.enabled)
    flags = [bool(e.skipped) for e in trace.events_of(ScalerStep)]
    scales = [u.scale_after for u in trace.events_of(Update) if u.scale_after]
    return scale_reset_finding(ScaleReset(
        rung, label, len(resets), built, tuple(flags), tuple(scales), first.reached,
        first.restarted, first.init.growth_interval, own_scaler=own_scaler,
        location=location(first.init.site)))
