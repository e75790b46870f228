"""The closed vocabularies of the record: diagnosis kinds, rung ids (in ladder order), finding
severities and rung statuses, each a string enum.

A member *is* its string: it compares equal to it, hashes like it (a dict keyed by the plain
string finds it), and `str()`, `format()`, f-strings and `json.dumps` give the bare value, so
the record and every rendering read exactly as with plain strings. Python 3.10 has no
`enum.StrEnum`; `StrEnum` below is the same idea for every supported version.

This module must not import torch: `report` and `explain` run without it.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["StrEnum", "KindId", "RungId", "Severity", "Status"]


class StrEnum(str, Enum):
    """A string enum whose members print as their value (not `Class.MEMBER`)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class KindId(StrEnum):
    """Every diagnosis kind of the contract, in the order `ampdoctor explain` lists them (the
    text of each is `kinds.CATALOGUE[kind]`)."""

    NONDETERMINISTIC_BASELINE = "nondeterministic-baseline"
    MISSING_ACCUMULATION_AVERAGE = "missing-accumulation-average"
    DOUBLE_AVERAGE = "double-average"
    REDUCTION_MISMATCH = "reduction-mismatch"
    WEIGHTED_AVERAGE_MISMATCH = "weighted-average-mismatch"
    STEP_PER_MICROBATCH = "step-per-microbatch"
    ZERO_GRAD_INSIDE_ACCUMULATION = "zero-grad-inside-accumulation"
    MISSING_NO_SYNC = "missing-no-sync"
    HALF_OPEN_AMP = "half-open-amp"
    CLIP_BEFORE_UNSCALE = "clip-before-unscale"
    MISSING_UNSCALE = "missing-unscale"
    UNSCALE_TWICE = "unscale-twice"
    UPDATE_PER_MICROBATCH = "update-per-microbatch"
    DOUBLE_SCALING = "double-scaling"
    SCHEDULER_PER_MICROBATCH = "scheduler-per-microbatch"
    SCHEDULER_STEPS_ON_SKIP = "scheduler-steps-on-skip"
    NO_ZERO_GRAD_AFTER_SKIP = "no-zero-grad-after-skip"
    MISSING_ZERO_GRAD = "missing-zero-grad"
    FREQUENT_SKIPS = "frequent-skips"
    GRADIENT_MISMATCH = "gradient-mismatch"
    LOOP_ERROR = "loop-error"


class RungId(StrEnum):
    """The rungs, in ladder order (the order they run and are reported)."""

    REPRODUCIBILITY = "reproducibility"
    FP32_ACCUM = "fp32-accum"
    BF16_NO_SCALER = "bf16-no-scaler"
    FP16_SCALER = "fp16-scaler"
    DOUBLE_SCALING = "double-scaling"
    CLIP_SPACE = "clip-space"
    SKIPS = "skips"
    DDP_SYNC = "ddp-sync"


class Severity(StrEnum):
    """An `error` fails its rung; a `warning` leaves it `warn`."""

    ERROR = "error"
    WARNING = "warning"


class Status(StrEnum):
    """What a rung established."""

    PASS = "pass"
    FAIL = "fail"
    WARN = "warn"
    SKIP = "skip"
    NOT_RUN = "not-run"
