"""The fp32 reference's kind: `nondeterministic-baseline`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from ..enums import KindId
from ..findings import Finding
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
        "repeat tolerance: no later comparison could mean anything."),
    measured="relative difference of two fp32 runs at the same weights",
    decided_in=f"{__name__}:nondeterministic_baseline",
)


def nondeterministic_baseline(seen: Observed) -> Finding:
    """`nondeterministic-baseline`: the fp32 reference is not repeatable.
    Error: two fp32 reference runs differ (always measured).
    (`NONDETERMINISTIC_BASELINE.error_when`)"""
    return Finding(seen.rung, KindId.NONDETERMINISTIC_BASELINE, seen.severity,
                   **seen.fields(NONDETERMINISTIC_BASELINE))
