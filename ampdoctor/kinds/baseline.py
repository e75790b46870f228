"""The fp32 reference's kind: `nondeterministic-baseline`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.enums import KindId, Severity, StrEnum
from ..core.evidence import Evidence, significant
from ..core.findings import Finding, Location
from .base import Kind, Observed

NONDETERMINISTIC_BASELINE = Kind(
    KindId.NONDETERMINISTIC_BASELINE,
    title="The fp32 reference is not repeatable",
    why=(
        "Two fp32 runs from identical weights and data give different gradients, so any later "
        "difference could be noise. Usually the loop (or the loss) draws random numbers outside "
        "the model's forward, or a random layer runs in a forward ampdoctor could not match to "
        "its micro-batch."),
    fix=(
        "Dropout inside the model is fine (`dropout: align`, the default, gives every forward of "
        "micro-batch i the same random state in every run). Randomness drawn outside the model's "
        "forward cannot be aligned: move it into `forward()` (e.g. a `GaussianNoise` module that "
        "adds `torch.randn_like(x) * std` when `self.training`), derive it from a generator "
        "seeded per micro-batch (`torch.Generator().manual_seed(step)`), or switch it off for "
        "the triage; `dropout: off` in the spec sets every dropout to p=0."),
    example=(
        "for x, y in micro_batches:\n"
        "    x = x + 0.01 * torch.randn_like(x)    # augmentation drawn in the loop\n"
        "    with torch.autocast(run.device_type, dtype=run.autocast_dtype,\n"
        "                        enabled=run.autocast_dtype is not None):\n"
        "        loss = criterion(model(x), y) / K"),
    error_when=(
        "two fp32 runs of the reference from the same weights and data differ beyond the "
        "repeat tolerance: no later comparison could mean anything. Warning: two runs of a "
        "script read different data in their first window (nothing is compared, no update "
        "judged)."),
    measured="relative difference of two fp32 runs at the same weights",
    decided_in=f"{__name__}:nondeterministic_baseline",
)


def nondeterministic_baseline(seen: Observed) -> Finding:
    """`nondeterministic-baseline`: the fp32 reference is not repeatable.
    Error: two fp32 reference runs differ (always measured).
    (`NONDETERMINISTIC_BASELINE.error_when`)"""
    return Finding(seen.rung, KindId.NONDETERMINISTIC_BASELINE, seen.severity,
                   **seen.fields(NONDETERMINISTIC_BASELINE))


class Runs(StrEnum):
    """Which two runs that should agree were compared (the subject of the message)."""

    REFERENCE = "Two fp32 reference gradients at the same weights"
    LOOP = "Two fp32 runs of the loop from the same weights"
    SCRIPT_DATA = "two runs of the script read different data"
    SCRIPT = "Two fp32 runs of the script from the same weights on the same data"
    SCRIPT_REFERENCE = "Two runs of the reference (--reference-args) at the same weights"


@dataclass(frozen=True)
class NotRepeatable:
    """What the reproducibility rung measured of two fp32 runs that should agree: their
    relative difference (`rel_err`, None when they read different data and nothing was
    compared), the cosine, the repeat tolerance, and what may draw the randomness: the model's
    active random layers (`random_modules`, None when the rung does not list them; their
    forwards `aligned` per micro-batch or not) or a draw outside the model's forward
    (`random_site`)."""

    rung: str
    runs: Runs
    rel_err: float | None = None
    cosine: float | None = None
    tolerance: float = 0.0
    random_modules: tuple[str, ...] | None = None
    aligned: bool = False
    random_site: Location | None = None
    location: Location | None = None


def _randomness(o: NotRepeatable) -> str:
    """Where the randomness may come from, for the diagnose's two comparisons."""
    site, modules = o.random_site, list(o.random_modules or ())
    if site is not None:
        return (f" The loop draws random numbers outside the model's forward (first at "
                f"{site.file}:{site.line}), where ampdoctor cannot give every run "
                "the same random state.")
    if modules and not o.aligned:
        return f" Random layers active in the model: {', '.join(modules)}."
    if modules:
        return (f" Random layers active in the model: {', '.join(modules)}; their forwards "
                "were aligned per micro-batch, so the randomness comes from elsewhere (the "
                "loss, or a forward ampdoctor could not match to its micro-batch).")
    return " No dropout-like layer was found: the loss or the loop draws random numbers."


def not_repeatable(o: NotRepeatable) -> Finding:
    """`nondeterministic-baseline` from what the rung measured: an error when two runs that
    read the same data differ (every later comparison would be noise); a warning when a script's
    two runs read different data (nothing compared, the rungs keep what needs no reference)."""
    if o.runs is Runs.SCRIPT_DATA:
        return nondeterministic_baseline(Observed(
            o.rung, Severity.WARNING,
            "Two runs of the script with the same arguments read different data in their "
            "first window: it shuffles or draws its data without a fixed seed. Nothing can "
            "be compared with a reference run; the rungs keep what needs no reference. Seed "
            "the data (torch.manual_seed before the data is built, "
            "DataLoader(..., generator=torch.Generator().manual_seed(0))) or turn shuffling "
            "off for the triage.",
            evidence={"measured": "different data", "expected": "the same data"},
            location=o.location))
    rel = o.rel_err if o.rel_err is not None else float("nan")
    evidence: Evidence = {"measured": significant(rel), "expected": 0.0}
    if o.runs is Runs.SCRIPT_REFERENCE:
        text = (f"{o.runs} differ by {rel:.3g} (relative): the fp32 reference is not "
                "repeatable.")
    elif o.runs is Runs.SCRIPT:
        site = o.random_site
        text = (f"{o.runs} consumed different first updates (relative difference {rel:.3g}): "
                "something in the script is random outside its data"
                + (f" (it draws random numbers at {site.file}:{site.line})" if site else "")
                + ", so later differences would mean nothing.")
        evidence["tolerance"] = o.tolerance
    else:
        cosine = o.cosine if o.cosine is not None else float("nan")
        text = (f"{o.runs} differ by {rel:.3g} (relative) under a different RNG state "
                f"(cosine {cosine:.5f}).{_randomness(o)}")
        evidence.update({"tolerance": o.tolerance, "cosine": significant(cosine),
                         "random_modules": list(o.random_modules or ())})
    return nondeterministic_baseline(Observed(o.rung, Severity.ERROR, text, evidence=evidence,
                                              location=o.location))
