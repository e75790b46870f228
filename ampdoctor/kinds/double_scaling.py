"""The kind of two loss-scale state machines on one loss: `double-scaling`, seen by the run (a
second scale on the loss reaching backward, `SecondScale`; scaler.scale() of a scaled loss,
`ScaledTwice`) or by the static scan (owners on one training path).

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, and its one decider (`decided_in`), the only function that builds a
`Finding` of it, with the functions that word what a rule measured.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from ..core.enums import KindId, Severity
from ..core.evidence import significant
from ..core.findings import Finding, Location
from .base import Kind, Observed

DOUBLE_SCALING = Kind(
    KindId.DOUBLE_SCALING,
    title="Two loss-scale state machines on one loss",
    why=(
        "The loss is scaled twice (two GradScalers, a GradScaler inside "
        "DeepSpeed/Trainer/accelerate/"
        "Lightning AMP, or a constant loss scale on top of a GradScaler): skips, scale and "
        "clipping "
        "no longer mean anything."),
    fix=(
        "Keep exactly one owner of loss scaling: either the framework's (DeepSpeed `fp16.enabled`, "
        "`TrainingArguments(fp16=True)`, `Accelerator(mixed_precision='fp16')`, Lightning "
        "`precision='16-mixed'`) with no GradScaler of your own, or your GradScaler with the "
        "framework's fp16 off; delete any constant `loss * loss_scale` left from apex-era code."),
    example=(
        "static_loss_scale = 128.0                     # left over from apex O2\n"
        "scaler = torch.amp.GradScaler(\"cuda\")\n"
        "...\n"
        "scaler.scale(loss * static_loss_scale).backward()"),
    error_when=(
        "the loss reaching backward carries a second scale factor (measured in the fp16 run), "
        "or two loss-scale owners stand on one training path; for two GradScalers of the "
        "diagnosed loop, only when the run saw them on one loss or one optimizer's gradients "
        "(one scaled what the other unscales or steps, both step one optimizer, or one scaled "
        "an already scaled loss); each on its own losses and optimizer is no finding. "
        "Warning: owners in separate entry points that no scanned file runs together, or two "
        "GradScalers of the loop that no run could tell apart."),
    measured="effective loss scale; loss-scale owners on one path",
    decided_in=f"{__name__}:double_scaling",
)


def double_scaling(seen: Observed) -> Finding:
    """`double-scaling`: two loss-scale state machines on one loss.
    Error: a second scale factor measured, or two owners on one path (two GradScalers: seen
    by the run on one loss or optimizer); warning: separate entry points, or GradScalers no
    run could tell apart. (`DOUBLE_SCALING.error_when`)"""
    return Finding(seen.rung, KindId.DOUBLE_SCALING, seen.severity, **seen.fields(DOUBLE_SCALING))


@dataclass(frozen=True)
class ScaledTwice:
    """scaler.scale() given a loss already scaled by `first_scale`: the effective loss scale
    is first_scale x scale."""

    kind: ClassVar[KindId] = KindId.DOUBLE_SCALING
    rung: str
    window: int
    scale: float | None
    first_scale: float
    skipped_steps: int
    location: Location | None = None


def scaled_twice(o: ScaledTwice) -> Finding:
    """`double-scaling` from the state machine: a second scale factor measured in the run, an
    error."""
    effective = o.first_scale * (o.scale or 1)
    message = (f"scaler.scale() was applied to a loss that was already scaled by "
               f"{o.first_scale:g}: the effective loss scale is {effective:.6g}, not "
               f"{o.scale:g}.")
    return double_scaling(Observed(
        o.rung, Severity.ERROR, message,
        evidence={"scale": o.scale, "window": o.window, "measured": significant(effective),
                  "expected": o.scale, "skipped_steps": o.skipped_steps},
        location=o.location))


@dataclass(frozen=True)
class SecondScale:
    """The fp16 run's first backward against the fp32 run's at identical weights and data: the
    loss reaching backward was `extra` x (fp32 loss x scale), a second scale besides the
    GradScaler's."""

    rung: str
    fp32_loss: float
    fp16_loss: float
    scale: float
    extra: float
    skipped_steps: int
    scaler_steps: int
    location: Location | None = None


def second_scale(o: SecondScale) -> Finding:
    """`double-scaling` measured in the run: an error (the effective scale is another)."""
    extra = abs(o.extra)
    return double_scaling(Observed(o.rung, Severity.ERROR,
        f"The loss reaching backward is {extra:.6g}x what the scaler alone would give "
        f"(fp32 loss {o.fp32_loss:.6g} x scale {o.scale:g} = {o.fp32_loss * o.scale:.6g}, got "
        f"{o.fp16_loss:.6g}): a second, hand-written loss scale sits on top of the GradScaler. "
        f"Effective scale {extra * o.scale:.6g}; {o.skipped_steps} of {o.scaler_steps} steps "
        "were skipped.",
        evidence={"measured": significant(extra * o.scale), "expected": o.scale,
                  "extra_factor": significant(extra), "skipped_steps": o.skipped_steps,
                  "scaler_steps": o.scaler_steps},
        location=o.location))


class Outcome(Enum):
    """What the packages do with an HF Trainer and a DeepSpeed config that disagree on the
    precision (transformers 5.25, accelerate 1.16, DeepSpeed 0.19.8, measured): the value is
    the sentence the finding says."""

    #: the config enables the other half precision: accelerate raises building the Trainer
    REFUSED_BY_ACCELERATE = (
        "accelerate refuses it when the Trainer is built (\"`--mixed_precision` arg cannot be "
        "set to ... when ... is set in the DeepSpeed config file\"), so nothing trains")
    #: a section explicitly on (or off) against the Trainer's ask: transformers raises in train()
    REFUSED_BY_TRANSFORMERS = (
        "transformers refuses it when trainer.train() starts (\"Please correct the following "
        "DeepSpeed config values that mismatch TrainingArguments values\"), so nothing trains")
    #: the asked precision's section has no `enabled`: it runs, in fp32
    RUNS_FP32 = (
        "nobody refuses it: transformers and accelerate fill in only \"auto\" values and absent "
        "sections, DeepSpeed leaves a section without `enabled` off, and the engine trains in "
        "fp32 while the Trainer asked for half precision")


@dataclass(frozen=True)
class PrecisionsDisagree:
    """The HF Trainer asks for one precision and hands DeepSpeed a config whose precision
    section says otherwise (both settings own the one engine's precision)."""

    rung: str
    asked: str                  # the Trainer's ("fp32", "fp16", "bf16")
    asked_at: str               # where, as the scan shows it
    config_state: str           # the config's section and its state ("fp16:on", "bf16:off",
                                # "bf16:unset": a section without `enabled`)
    config_key: str             # its key path ("fp16.enabled", "bf16")
    config_at: str
    outcome: Outcome
    entry: str
    owners: tuple[dict[str, Any], ...]
    location: Location | None = None


def _config_says(state: str) -> str:
    section, how = state.split(":", 1)
    return {"on": f"enables {section}", "off": f"switches {section} off (`enabled: false`)",
            "unset": f"has a {section} section without `enabled`"}.get(how, state)


def precisions_disagree(o: PrecisionsDisagree) -> Finding:
    """`double-scaling` of two precision owners on one engine: an error (transformers or
    accelerate refuses the run, or the engine trains in fp32 while half precision was asked)."""
    section = o.config_state.split(":", 1)[0]
    asked = "neither fp16 nor bf16 (fp32)" if o.asked == "fp32" else o.asked
    return double_scaling(Observed(o.rung, Severity.ERROR,
        f"The HF Trainer asks for {asked} ({o.asked_at}) and hands DeepSpeed a config that "
        f"{_config_says(o.config_state)} ({o.config_at}): two settings own the precision of "
        f"one engine and disagree; {o.outcome.value}.",
        evidence={"measured": 2, "expected": 1, "scope": "same-path", "entry": o.entry,
                  "owners": list(o.owners), "trainer_precision": o.asked,
                  "config_key": o.config_key, "config_state": o.config_state,
                  "outcome": o.outcome.name.lower().replace("_", "-")},
        location=o.location,
        fix=(f'Set the config\'s "{section}" `enabled` (and the other half precision\'s) to '
             '"auto", so the Trainer fills them in from TrainingArguments, or make both ask for '
             "the same precision.")))


class Untold(Enum):
    """Why the runs could not tell whether two GradScalers on one path act on one loss."""

    #: no run of the loop had a GradScaler enabled
    NONE_ENABLED = (" No run of this loop had a GradScaler enabled, so none could tell whether "
                    "they act on one loss.")
    #: a run saw at least one of them scale no loss or step no optimizer
    UNUSED = (" The run could not tell whether they act on one loss: at least one of them "
              "scaled no loss or stepped no optimizer.")


@dataclass(frozen=True)
class OwnersOnOnePath:
    """The static scan: loss-scale owners (`owners`, the scan's `machine_dict`s) on the training
    path of one entry point, located at the one to remove."""

    rung: str
    owners: tuple[dict[str, Any], ...]
    entry: str
    entry_shown: str                # the entry point as the scan shows it
    owners_shown: tuple[str, ...]   # each owner as the scan shows it (`describe_owner`)
    #: what a run saw them share, as the double-scaling rung words it ("" when no run looked)
    met: str = ""
    #: why the runs could not tell them apart (a warning), None where nothing says so
    untold: Untold | None = None
    location: Location | None = None


def owners_on_one_path(o: OwnersOnOnePath) -> Finding:
    """`double-scaling` of owners on one path: an error, a warning where the runs could not
    tell whether two GradScalers act on one loss."""
    note = o.met + (o.untold.value if o.untold else "")
    return double_scaling(Observed(
        o.rung, Severity.WARNING if o.untold else Severity.ERROR,
        f"{len(o.owners)} loss-scale owners on one training path (entry point "
        f"{o.entry_shown}): {'; '.join(o.owners_shown)}.{note}",
        evidence={"owners": list(o.owners), "measured": len(o.owners), "expected": 1,
                  "scope": "same-path", "entry": o.entry},
        location=o.location))


@dataclass(frozen=True)
class OwnersApart:
    """The static scan: loss-scale owners of different frameworks, each on the path of other
    entry points; no scanned file runs them together."""

    rung: str
    owners: tuple[dict[str, Any], ...]
    #: each owner as the scan shows it, with the entry points (shown) whose path it is on
    shown: tuple[tuple[str, tuple[str, ...]], ...]
    entries: tuple[str, ...]
    location: Location | None = None


def owners_apart(o: OwnersApart) -> Finding:
    """`double-scaling` of owners in separate entry points: a warning (no run combines them
    that the scan could see)."""
    names = "; ".join(f"{owner} (entry point {', '.join(entries)})"
                      for owner, entries in o.shown)
    return double_scaling(Observed(
        o.rung, Severity.WARNING,
        f"{len(o.owners)} loss-scale owners of different kinds in separate entry points: "
        f"{names}. No scanned file runs them together; check that no launcher, command line "
        "or config combines them on one loss.",
        evidence={"owners": list(o.owners), "measured": len(o.owners), "expected": 1,
                  "scope": "separate-entry-points", "entries": sorted(o.entries)},
        location=o.location))
