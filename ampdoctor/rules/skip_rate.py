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
import os
from dataclasses import dataclass

from .. import compare, deciders, thresholds
from ..deciders import Observed
from ..enums import Severity
from ..evidence import Evidence
from ..findings import Finding, location
from ..probe.events import Scale, ScalerInit, ScalerStep, Unscale, Update
from ..session import Trace


@dataclass(frozen=True)
class _Skips:
    """The plain fp16 run's scale trajectory, cut into its two phases."""

    steps: int                    # scaler.step calls
    skipped: list[ScalerStep]     # the skipped ones
    scales: list[float]           # the scale after each update
    flags: list[bool]             # skipped or not, per step
    first_ok: int                 # the first real update (len(flags) if none)
    excess: int                   # search skips beyond the halvings the search needed
    inits: list[ScalerInit]       # the enabled scalers' settings
    grew_into_overflow: bool      # a skip right after the scale grew

    @property
    def rate(self) -> float:
        return len(self.skipped) / self.steps if self.steps else 0.0

    @property
    def collapsed(self) -> bool:
        return bool(self.scales) and min(self.scales) < thresholds.MIN_SCALE

    @property
    def after(self) -> list[bool]:
        """The steps after the first real update."""
        return self.flags[self.first_ok + 1:]

    @property
    def skipped_after(self) -> int:
        return sum(self.after)

    @property
    def never_settled(self) -> bool:
        return len(self.flags) >= 2 and self.first_ok == len(self.flags)

    @property
    def growth_interval(self) -> int | None:
        return self.inits[0].growth_interval if self.inits else None

    @property
    def sawtooth(self) -> bool:
        """Growing into overflow once per growth_interval is already more than the threshold
        (the sawtooth of growth_interval=1)."""
        return (self.grew_into_overflow and self.growth_interval is not None
                and 1.0 / (self.growth_interval + 1) > thresholds.SKIP_RATE_THRESHOLD)

    def frequent(self, count: int, out_of: int) -> bool:
        enough = count >= thresholds.MIN_COUNTED_SKIPS or (count >= 1 and self.sawtooth)
        return enough and out_of > 0 and count / out_of > thresholds.SKIP_RATE_THRESHOLD

    @property
    def dropping(self) -> bool:
        """Skips after the first real update alone: updates the reference makes and this run
        drops."""
        return self.frequent(self.skipped_after, len(self.after))

    @property
    def unsettled(self) -> bool:
        counted = self.skipped_after + (self.excess if not self.never_settled else 0)
        return self.frequent(counted, len(self.after) + self.excess)


def _skips(plain: Trace) -> _Skips:
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
    return _Skips(len(steps), [e for e in steps if e.skipped],
                  [e.scale_after for e in updates if e.scale_after is not None], flags,
                  first_ok, first_ok - _search_skips(first_ok, updates),
                  [e for e in plain.events_of(ScalerInit) if e.enabled], grew_into_overflow)


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
    costs anyway. Skips after the first real update drop updates the reference makes: an error
    in a run whose own precision uses a GradScaler (`deciders.skip_severity`); the scale
    settling, or a run forced into fp16 (`own_scaler` false), a warning."""
    s = _skips(plain)
    if not (s.never_settled or s.unsettled or s.collapsed):
        return None
    site = s.inits[0].site if s.inits else (s.skipped[0].site if s.skipped else None)
    after, skipped_after = s.after, s.skipped_after
    evidence: Evidence = {"measured": compare._round(s.rate), "expected": 0.0,
                          "threshold": thresholds.SKIP_RATE_THRESHOLD, "skipped": len(s.skipped),
                          "initial_search_skips": s.first_ok,
                          "search_skips_beyond_halvings": s.excess,
                          "skipped_after_first_update": skipped_after,
                          "steps_after_first_update": len(after),
                          "skip_rate_after_first_update": (
                              compare._round(skipped_after / len(after)) if after else 0.0),
                          "steps": s.steps, "scale": s.scales,
                          "growth_interval": s.growth_interval,
                          "growth_factor": s.inits[0].growth_factor if s.inits else None}
    fell = f"the scale fell to {min(s.scales):g}" if s.collapsed else ""
    forced = "" if own_scaler else deciders.FORCED_FP16
    if s.dropping:
        return deciders.frequent_skips(Observed(rung,
            deciders.skip_severity(True, own_scaler=own_scaler),
            f"After its first real update (step {s.first_ok}) the fp16 run skipped "
            f"{skipped_after} of the {len(after)} steps that followed "
            f"({skipped_after / len(after):.0%}, threshold "
            f"{thresholds.SKIP_RATE_THRESHOLD:.0%}){_growth_note(s)}: the scaler had found a "
            f"scale that works, and each of these skips drops an update the fp32 reference makes"
            + _settling_note(s) + (f"; {fell}" if fell else "") + "." + forced,
            evidence=evidence, location=location(site)))
    return deciders.frequent_skips(Observed(rung, Severity.WARNING,
        f"The fp16 run skipped {len(s.skipped)} of {s.steps} optimizer steps "
        f"({s.rate:.0%}, threshold {thresholds.SKIP_RATE_THRESHOLD:.0%})"
        + (f" and {fell}" if fell else "")
        + ": fewer real updates than the schedule assumes." + forced,
        evidence=evidence, location=location(site)))


def _growth_note(s: _Skips) -> str:
    """What grew the scale back into overflow, when it did."""
    if not (s.grew_into_overflow and s.inits and s.inits[0].growth_factor):
        return ""
    every = ("every good step" if s.growth_interval == 1
             else f"every {s.growth_interval} good steps")
    return (f" (growth_factor {s.inits[0].growth_factor:g} after {every} grows the scale "
            "back into overflow)")


def _settling_note(s: _Skips) -> str:
    """The leading skips, not counted: the scale settling (and how many were a slow search)."""
    if not s.first_ok:
        return ""
    return (f" (the {s.first_ok} skip(s) before it were the scale settling, not counted here"
            + (f"; {s.excess} of them more than its halvings needed, a slow backoff_factor"
               if s.excess else "") + ")")


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


RESET_FIX = ("Build the GradScaler once, before the training loop, and hand the same object to "
             "every step (a `scaler` argument of the step function, or an attribute of the "
             "trainer): its scale and growth tracker must live as long as the training. To "
             "resume, restore it with `scaler.load_state_dict(checkpoint['scaler'])`.")


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
    fell = first.restarted > first.reached
    site = first.init.site
    where = f" at {os.path.basename(site.file)}:{site.line}" if site is not None else ""
    return deciders.frequent_skips(Observed(rung,
        deciders.skip_severity(True, own_scaler=own_scaler),
        f"The {label} built {built} GradScalers for {len(flags)} optimizer steps, each "
        f"replacing the last (the GradScaler(...) call{where} runs again inside the training "
        f"loop): the loss-scale state machine starts over with every new scaler. The scale "
        f"{'backed off' if fell else 'moved'} to {first.reached:g}, yet the next step started "
        f"again from {first.restarted:g} (scale after each update: "
        f"{', '.join(f'{v:g}' for v in scales)})"
        + (": a backoff never lasts, so an overflow at the initial scale recurs on every step"
           if fell else "") + "; and the scale never grows (growth needs "
        f"{first.init.growth_interval} good steps of one scaler). "
        f"{sum(flags)} of {len(flags)} steps were skipped."
        + ("" if own_scaler else deciders.FORCED_FP16),
        evidence={"measured": first.restarted, "expected": first.reached,
                  "scale_resets": len(resets), "scalers_built": built, "steps": len(flags),
                  "skipped": sum(flags), "scale": scales,
                  "growth_interval": first.init.growth_interval},
        location=location(site), fix=RESET_FIX))
