"""The kind of a GradScaler that skips too often: `frequent-skips`, judged from the plain fp16
run's scale trajectory (`SkipTrajectory`: the settling before the first real update, the skips
after it), a scaler rebuilt mid-run (`ScaleReset`) and the sentinel's steady skips in a real
training (`SteadySkips`).

This unit holds the kind's catalogue text, the measured consequence that makes it an error, and
the functions that decide its severity and word its message and evidence (rounding once here).

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..core import thresholds
from ..core.enums import KindId, Severity
from ..core.evidence import Evidence, significant
from ..core.findings import Finding, Location
from .base import FORCED_FP16, Kind, Observed, skip_severity

FREQUENT_SKIPS = Kind(
    KindId.FREQUENT_SKIPS,
    title="fp16 skips updates too often",
    why=(
        "Many optimizer steps are skipped for overflow, or the scale collapses: fewer real updates "
        "than the schedule assumes."),
    fix=(
        "Start from GradScaler's defaults (`init_scale=2**16, growth_interval=2000, "
        "backoff_factor=0.5`); if it still skips, look for the overflow source (learning rate, "
        "initialisation, bad data, a loss summed instead of averaged) before tuning the scaler, "
        "or train in bf16."),
    example=(
        "scaler = torch.amp.GradScaler(\"cuda\", init_scale=2.0 ** 24,\n"
        "                              growth_interval=1)  # grows into overflow"),
    error_when=(
        "after the first real update more than `SKIP_RATE_THRESHOLD` of the steps were skipped "
        "(at least `MIN_COUNTED_SKIPS`, or one right after growing at a short growth_interval): "
        "updates the reference makes are dropped; or a GradScaler rebuilt during training "
        "restarted the scale (the next step started from another scale than the last update "
        "left): a backoff that does not last. Warning: the scale settling, a scale below "
        "`MIN_SCALE`, a run that never settles, and any of it in a run forced into fp16."),
    measured="fraction of fp16 steps skipped",
    decided_in=f"{__name__}:frequent_skips",
)



def frequent_skips(seen: Observed) -> Finding:
    """`frequent-skips`: fp16 skips updates too often.
    Error: skips after the first real update above the threshold (`skip_severity`); warning:
    settling. (`FREQUENT_SKIPS.error_when`)"""
    return Finding(seen.rung, KindId.FREQUENT_SKIPS, seen.severity, **seen.fields(FREQUENT_SKIPS))


@dataclass(frozen=True)
class SkipTrajectory:
    """The plain fp16 run's scale trajectory, cut into its two phases: before the first real
    update the scaler is settling (searching down from init_scale), after it every skip drops
    an update the fp32 reference makes."""

    rung: str
    flags: tuple[bool, ...]       # skipped or not, per scaler.step
    scales: tuple[float, ...]     # the scale after each update
    first_ok: int                 # the first real update (len(flags) if none)
    excess: int                   # search skips beyond the halvings the search needed
    growth_interval: int | None   # the first enabled scaler's settings
    growth_factor: float | None
    grew_into_overflow: bool      # a skip right after the scale grew
    own_scaler: bool = True       # the user's own precision uses a GradScaler
    location: Location | None = None

    @property
    def steps(self) -> int:
        return len(self.flags)

    @property
    def skipped(self) -> int:
        return sum(self.flags)

    @property
    def rate(self) -> float:
        return self.skipped / self.steps if self.steps else 0.0

    @property
    def collapsed(self) -> bool:
        return bool(self.scales) and min(self.scales) < thresholds.MIN_SCALE

    @property
    def after(self) -> tuple[bool, ...]:
        """The steps after the first real update."""
        return self.flags[self.first_ok + 1:]

    @property
    def skipped_after(self) -> int:
        return sum(self.after)

    @property
    def never_settled(self) -> bool:
        return len(self.flags) >= 2 and self.first_ok == len(self.flags)

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


def _growth_note(s: SkipTrajectory) -> str:
    """What grew the scale back into overflow, when it did."""
    if not (s.grew_into_overflow and s.growth_factor):
        return ""
    every = ("every good step" if s.growth_interval == 1
             else f"every {s.growth_interval} good steps")
    return (f" (growth_factor {s.growth_factor:g} after {every} grows the scale "
            "back into overflow)")


def _settling_note(s: SkipTrajectory) -> str:
    """The leading skips, not counted: the scale settling (and how many were a slow search)."""
    if not s.first_ok:
        return ""
    return (f" (the {s.first_ok} skip(s) before it were the scale settling, not counted here"
            + (f"; {s.excess} of them more than its halvings needed, a slow backoff_factor"
               if s.excess else "") + ")")


def skip_trajectory(s: SkipTrajectory) -> Finding | None:
    """`frequent-skips` from the plain fp16 run's skips, or None when they are what GradScaler
    costs anyway. Skips after the first real update above the threshold drop updates the
    reference makes: an error in a run whose own precision uses a GradScaler (`skip_severity`);
    the scale settling (a slow search, a run that never settles) or a scale below `MIN_SCALE`,
    a warning; all of it a warning in a run forced into fp16."""
    if not (s.never_settled or s.unsettled or s.collapsed):
        return None
    after, skipped_after = s.after, s.skipped_after
    evidence: Evidence = {"measured": significant(s.rate), "expected": 0.0,
                          "threshold": thresholds.SKIP_RATE_THRESHOLD, "skipped": s.skipped,
                          "initial_search_skips": s.first_ok,
                          "search_skips_beyond_halvings": s.excess,
                          "skipped_after_first_update": skipped_after,
                          "steps_after_first_update": len(after),
                          "skip_rate_after_first_update": (
                              significant(skipped_after / len(after)) if after else 0.0),
                          "steps": s.steps, "scale": list(s.scales),
                          "growth_interval": s.growth_interval,
                          "growth_factor": s.growth_factor}
    fell = f"the scale fell to {min(s.scales):g}" if s.collapsed else ""
    forced = "" if s.own_scaler else FORCED_FP16
    if s.dropping:
        return frequent_skips(Observed(s.rung,
            skip_severity(True, own_scaler=s.own_scaler),
            f"After its first real update (step {s.first_ok}) the fp16 run skipped "
            f"{skipped_after} of the {len(after)} steps that followed "
            f"({skipped_after / len(after):.0%}, threshold "
            f"{thresholds.SKIP_RATE_THRESHOLD:.0%}){_growth_note(s)}: the scaler had found a "
            f"scale that works, and each of these skips drops an update the fp32 reference makes"
            + _settling_note(s) + (f"; {fell}" if fell else "") + "." + forced,
            evidence=evidence, location=s.location))
    return frequent_skips(Observed(s.rung, Severity.WARNING,
        f"The fp16 run skipped {s.skipped} of {s.steps} optimizer steps "
        f"({s.rate:.0%}, threshold {thresholds.SKIP_RATE_THRESHOLD:.0%})"
        + (f" and {fell}" if fell else "")
        + ": fewer real updates than the schedule assumes." + forced,
        evidence=evidence, location=s.location))


RESET_FIX = ("Build the GradScaler once, before the training loop, and hand the same object to "
             "every step (a `scaler` argument of the step function, or an attribute of the "
             "trainer): its scale and growth tracker must live as long as the training. To "
             "resume, restore it with `scaler.load_state_dict(checkpoint['scaler'])`.")


@dataclass(frozen=True)
class ScaleReset:
    """A GradScaler built anew mid-run without its scale, as a run (`label`) showed it: the
    scale the replaced scaler's last update left (`reached`), the one the replacing scaler's
    first update started from (`restarted`), and the run's scale trajectory."""

    rung: str
    label: str                    # the run that showed it ("plain fp16 run", ...)
    resets: int                   # scalers that restarted the scale
    scalers_built: int
    flags: tuple[bool, ...]       # skipped or not, per scaler.step
    scales: tuple[float, ...]     # the scale after each update
    reached: float
    restarted: float
    growth_interval: int | None   # the replacing scaler's
    own_scaler: bool = True
    location: Location | None = None   # the GradScaler(...) call that runs again


def scale_reset(r: ScaleReset) -> Finding:
    """`frequent-skips` for a loss-scale state machine restarted mid-run. Its consequence is
    measured in the scale trajectory (a backoff undone, so an overflow at the initial scale
    never stops): an error in a run whose own precision uses a GradScaler (`skip_severity`)."""
    site = r.location
    where = f" at {os.path.basename(site.file)}:{site.line}" if site is not None else ""
    fell = r.restarted > r.reached
    steps, skipped = len(r.flags), sum(r.flags)
    return frequent_skips(Observed(r.rung,
        skip_severity(True, own_scaler=r.own_scaler),
        f"The {r.label} built {r.scalers_built} GradScalers for {steps} optimizer steps, each "
        f"replacing the last (the GradScaler(...) call{where} runs again inside the training "
        f"loop): the loss-scale state machine starts over with every new scaler. The scale "
        f"{'backed off' if fell else 'moved'} to {r.reached:g}, yet the next step started "
        f"again from {r.restarted:g} (scale after each update: "
        f"{', '.join(f'{v:g}' for v in r.scales)})"
        + (": a backoff never lasts, so an overflow at the initial scale recurs on every step"
           if fell else "") + "; and the scale never grows (growth needs "
        f"{r.growth_interval} good steps of one scaler). "
        f"{skipped} of {steps} steps were skipped."
        + ("" if r.own_scaler else FORCED_FP16),
        evidence={"measured": r.restarted, "expected": r.reached,
                  "scale_resets": r.resets, "scalers_built": r.scalers_built, "steps": steps,
                  "skipped": skipped, "scale": list(r.scales),
                  "growth_interval": r.growth_interval},
        location=site, fix=RESET_FIX))


@dataclass(frozen=True)
class SteadySkips:
    """What the sentinel counted in a real training: skips after the scale settled (the first
    real update), out of the steps that followed, and the GradScaler's settings."""

    rung: str
    skipped: int
    steps: int
    scale: float
    growth_factor: float
    growth_interval: int
    backoff_factor: float
    location: Location | None = None

    @property
    def rate(self) -> float:
        return self.skipped / self.steps if self.steps > 0 else 0.0


def steady_skips(o: SteadySkips) -> Finding | None:
    """`frequent-skips` in a real training: an error when at least `MIN_COUNTED_SKIPS` steps
    were skipped after the scale settled at a rate above `SKIP_RATE_THRESHOLD` (those windows'
    data never reach the weights); None below it."""
    if not (o.skipped >= thresholds.MIN_COUNTED_SKIPS
            and o.rate > thresholds.SKIP_RATE_THRESHOLD):
        return None
    settings = (f"growth_factor={o.growth_factor:g}, growth_interval="
                f"{o.growth_interval}, backoff_factor={o.backoff_factor:g}")
    return frequent_skips(Observed(
        o.rung, Severity.ERROR,
        f"After the loss scale settled, {o.skipped} of the {o.steps} optimizer steps that "
        f"followed were skipped (inf/nan gradients; a rate of {o.rate:.0%}): those "
        f"windows' data never reaches the weights. The GradScaler runs with {settings}; "
        "the defaults (2.0, 2000, 0.5) settle to a skip every few thousand steps.",
        evidence={"measured": round(o.rate, 6), "expected": 0.0,
                  "threshold": thresholds.SKIP_RATE_THRESHOLD,
                  "skipped": o.skipped, "steps": o.steps, "scale": o.scale,
                  "growth_factor": o.growth_factor, "growth_interval": o.growth_interval},
        location=o.location))
