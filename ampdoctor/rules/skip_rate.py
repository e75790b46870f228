"""Rule `frequent-skips`: how often the plain fp16 run's GradScaler skipped its update, judged
in two phases.

Until its first real update the scaler is settling on a scale: it starts at `init_scale` and
backs off on every overflow, so leading skips are normal at the start of training (a slow
search -- a timid backoff_factor -- or a run too short to finish it is worth a warning). After
its first real update the scaler has found a scale that works, and every further skip drops an
update the fp32 reference makes: more of them than the threshold is an error (a growth_factor
or growth_interval that grows the scale into overflow again and again)."""

from __future__ import annotations

import math

from .. import compare, deciders, thresholds
from ..deciders import Observed
from ..enums import Severity
from ..evidence import Evidence
from ..findings import Finding, location
from ..probe.events import ScalerInit, ScalerStep, Update
from ..session import Trace


def frequent_skips(plain: Trace, rung: str) -> Finding | None:  # noqa: C901 - the phases of one scale trajectory, each with its count
    """The finding for the plain fp16 run's skips, or None when they are what GradScaler
    costs anyway."""
    steps = plain.events_of(ScalerStep)
    skipped = [e for e in steps if e.skipped]
    scales = [e.scale_after for e in plain.events_of(Update)
              if e.scale_after is not None]
    rate = len(skipped) / len(steps) if steps else 0.0
    collapsed = bool(scales) and min(scales) < thresholds.MIN_SCALE
    flags = [bool(e.skipped) for e in steps]
    # Leading skips are the scaler searching down from init_scale: normal at the start of
    # training. What counts is skipping once it has found a scale that works, or never finding
    # one within the run.
    first_ok = flags.index(False) if False in flags else len(flags)
    after = flags[first_ok + 1:]
    skipped_after = sum(after)
    never_settled = len(flags) >= 2 and first_ok == len(flags)
    # A search halves the scale per skip (the default backoff 0.5): it may take as many skips
    # as halvings between init_scale and the scale that worked. Skips beyond that (a timid
    # backoff_factor such as 0.9) are slow searching, and count.
    updates = plain.events_of(Update)
    search = first_ok
    if 0 < first_ok < len(updates):
        init = updates[0].scale_before
        found = updates[first_ok].scale_before
        if init and found and 0 < found <= init:
            search = min(first_ok, math.ceil(math.log2(init / found)
                                             - thresholds.SEARCH_HALVINGS_SLACK))
    excess = first_ok - search
    counted = skipped_after + (excess if not never_settled else 0)
    considered = len(after) + excess
    inits = [e for e in plain.events_of(ScalerInit) if e.enabled]
    growth_interval = inits[0].growth_interval if inits else None
    # A skip right after the scale grew is the scaler growing into overflow: once per
    # growth_interval in steady state, so one such skip already says "frequent" when that
    # interval is short (the sawtooth of growth_interval=1).
    grew_into_overflow = any(
        flag and i > 0 and _grew(updates[i - 1].scale_before, updates[i].scale_before)
        for i, flag in enumerate(flags[:len(updates)]))
    sawtooth = (grew_into_overflow and growth_interval is not None
                and 1.0 / (growth_interval + 1) > thresholds.SKIP_RATE_THRESHOLD)

    def frequent(count: int, out_of: int) -> bool:
        enough = count >= thresholds.MIN_COUNTED_SKIPS or (count >= 1 and sawtooth)
        return enough and out_of > 0 and count / out_of > thresholds.SKIP_RATE_THRESHOLD

    # Skips after the first real update alone: updates the reference makes and this run drops.
    dropping = frequent(skipped_after, len(after))
    unsettled = frequent(counted, considered)
    if not (never_settled or unsettled or collapsed):
        return None
    site = inits[0].site if inits else (skipped[0].site if skipped else None)
    evidence: Evidence = {"measured": compare._round(rate), "expected": 0.0,
                "threshold": thresholds.SKIP_RATE_THRESHOLD, "skipped": len(skipped),
                "initial_search_skips": first_ok, "search_skips_beyond_halvings": excess,
                "skipped_after_first_update": skipped_after,
                "steps_after_first_update": len(after),
                "skip_rate_after_first_update": (compare._round(skipped_after / len(after))
                                                 if after else 0.0),
                "steps": len(steps), "scale": scales, "growth_interval": growth_interval,
                "growth_factor": inits[0].growth_factor if inits else None}
    if dropping:
        every = ("every good step" if growth_interval == 1
                 else f"every {growth_interval} good steps")
        grow = (f" (growth_factor {inits[0].growth_factor:g} after {every} grows the scale "
                "back into overflow)" if grew_into_overflow and inits and inits[0].growth_factor
                else "")
        before = ""
        if first_ok:
            before = (f" (the {first_ok} skip(s) before it were the scale settling, not counted "
                      "here" + (f"; {excess} of them more than its halvings needed, a slow "
                                "backoff_factor" if excess else "") + ")")
        return deciders.frequent_skips(Observed(rung, Severity.ERROR,
            f"After its first real update (step {first_ok}) the fp16 run skipped "
            f"{skipped_after} of the {len(after)} steps that followed "
            f"({skipped_after / len(after):.0%}, threshold "
            f"{thresholds.SKIP_RATE_THRESHOLD:.0%}){grow}: the scaler had found a scale that "
            f"works, and each of these skips drops an update the fp32 reference makes"
            + before
            + (f"; the scale fell to {min(scales):g}" if collapsed else "") + ".",
            evidence=evidence, location=location(site)))
    return deciders.frequent_skips(Observed(rung, Severity.WARNING,
        f"The fp16 run skipped {len(skipped)} of {len(steps)} optimizer steps "
        f"({rate:.0%}, threshold {thresholds.SKIP_RATE_THRESHOLD:.0%})"
        + (f" and the scale fell to {min(scales):g}" if collapsed else "")
        + ": fewer real updates than the schedule assumes.",
        evidence=evidence, location=location(site)))


def _grew(before: float | None, after: float | None) -> bool:
    """The scale grew from one update to the next (both known and non-zero)."""
    return bool(after and before and after > before)
