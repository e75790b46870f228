"""The kind of a precision half switched on: `half-open-amp`.

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

HALF_OPEN_AMP = Kind(
    KindId.HALF_OPEN_AMP,
    title="Mixed precision is only half switched on (or off)",
    why=(
        "The precision the run asks for and what the code does disagree: a GradScaler left enabled "
        "in bf16, autocast never entered, autocast with another dtype, fp16 without a scaler, or "
        "a loop that casts the model's weights to fp16/bf16 (no fp32 master weights)."),
    fix=(
        "Branch on the precision in one place: `scaler = torch.amp.GradScaler(device_type, "
        "enabled=(precision == 'fp16'))` and `torch.autocast(device_type, dtype=amp_dtype, "
        "enabled=amp_dtype is not None)` with `amp_dtype` float16 for fp16, bfloat16 for bf16, "
        "None for fp32 (in the triage: `run.autocast_dtype`)."),
    example=(
        "scaler = torch.amp.GradScaler(\"cuda\")                # enabled in bf16 too\n"
        "for x, y in micro_batches:\n"
        "    with torch.autocast(\"cuda\", dtype=torch.float16):  # fp16 in every run\n"
        "        loss = criterion(model(x), y) / K\n"
        "    scaler.scale(loss).backward()"),
    error_when=(
        "the precision that ran is not the one the run asks for -- autocast never entered, "
        "entered with another dtype, or fp16 without an enabled GradScaler -- so the rung "
        "would judge a precision the training does not use; in the fp32 run, autocast entered "
        "and an update differs. Warning: a GradScaler enabled in bf16, or autocast in the fp32 "
        "run whose updates still match."),
    measured="autocast entered/enabled (dtype)",
    decided_in=f"{__name__}:half_open_amp",
)


def half_open_amp(seen: Observed) -> Finding:
    """`half-open-amp`: mixed precision is only half switched on (or off).
    Error: the precision that ran is not the one asked for (fp32: an update differs); warning: a
    scaler in bf16, autocast in an fp32 run that still matches. (`HALF_OPEN_AMP.error_when`)"""
    return Finding(seen.rung, KindId.HALF_OPEN_AMP, seen.severity, **seen.fields(HALF_OPEN_AMP))
