"""The kind of a precision half switched on: `half-open-amp`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.enums import KindId, Severity
from ..core.evidence import Evidence, significant
from ..core.findings import Finding, Location
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


# --- what the precision rungs saw ------------------------------------------------------------


@dataclass(frozen=True)
class AutocastOff:
    """A mixed-precision run whose autocast was never entered, or entered but never enabled."""

    rung: str
    precision: str
    wanted: str                 # the autocast dtype the precision asks for ("bfloat16", ...)
    device: str
    entered: int                # autocast entered on the device, none of them enabled
    scaler: bool                # an enabled GradScaler scales the loss
    location: Location | None = None


def autocast_off(o: AutocastOff) -> Finding:
    """`half-open-amp`: the precision that ran is fp32, not the one asked for (an error)."""
    seen = (f"autocast was entered {o.entered} time(s) but never enabled" if o.entered
            else "autocast was never entered")
    return half_open_amp(Observed(o.rung, Severity.ERROR,
        f"The {o.precision} run asked for autocast({o.wanted}) but {seen} on "
        f"{o.device}: every forward ran in fp32, so this 'mixed precision' run "
        "is really fp32" + (" with a loss scaler on top." if o.scaler else "."),
        evidence={"measured": 0, "expected": 1, "autocast_entered": o.entered,
                  "autocast_enabled": 0, "scaler_enabled": o.scaler},
        location=o.location))


@dataclass(frozen=True)
class AutocastDtype:
    """Autocast entered with another dtype than the precision asks for."""

    rung: str
    precision: str
    wanted: str
    dtype: str | None
    scaler: bool
    location: Location | None = None


def autocast_dtype(o: AutocastDtype) -> Finding:
    """`half-open-amp`: the loop ignores run.autocast_dtype (an error: another precision ran)."""
    return half_open_amp(Observed(o.rung, Severity.ERROR,
        f"The {o.precision} run entered autocast with dtype {o.dtype}, not "
        f"{o.wanted}: the loop ignores run.autocast_dtype"
        + (" and runs fp16 without the scaler it needs." if o.dtype == "float16"
           and not o.scaler else "."),
        evidence={"measured": o.dtype, "expected": o.wanted}, location=o.location))


@dataclass(frozen=True)
class Fp16WithoutScaler:
    """The fp16 run entered autocast(float16) with no enabled GradScaler."""

    rung: str
    location: Location | None = None


def fp16_without_scaler(o: Fp16WithoutScaler) -> Finding:
    """`half-open-amp`: fp16 without a scaler underflows and never detects overflow (an
    error)."""
    return half_open_amp(Observed(o.rung, Severity.ERROR,
        "The fp16 run enters autocast(float16) but no enabled GradScaler scales the loss: "
        "small fp16 gradients underflow to zero and overflow is never detected.",
        evidence={"measured": "no enabled scaler", "expected": "GradScaler enabled"},
        location=o.location))


@dataclass(frozen=True)
class ScalerInBf16:
    """A GradScaler enabled in bf16: in the bf16 run, or in a script whose autocast asks for
    bfloat16 only (`in_script`)."""

    rung: str
    scale: float | None
    in_script: bool = False
    location: Location | None = None


def scaler_in_bf16(o: ScalerInBf16) -> Finding:
    """`half-open-amp`: a scaler bf16 does not need (a warning: the update is the same, its
    skips hide real overflow)."""
    where = ("in the script, whose autocast asks for bfloat16 only" if o.in_script
             else "in the bf16 run")
    return half_open_amp(Observed(o.rung, Severity.WARNING,
        f"A GradScaler is enabled {where}. bf16 has fp32's exponent range and needs no "
        "loss scaling: the scaler only multiplies and divides, and its skipped steps hide real "
        "overflow. Enable it for fp16 only.",
        evidence={"measured": "enabled", "expected": "disabled", "scale": o.scale},
        location=o.location))


@dataclass(frozen=True)
class WeightsCast:
    """The loop cast the model's weights to a low precision: the dtypes, the tensors cast of
    the trainable ones (their first names), the line, whether the loop is also the reference,
    and the error it then raised (quoted), if any."""

    rung: str
    precision: str
    dtypes: tuple[str, ...]         # as torch names them ("torch.float16", ...)
    names: tuple[str, ...]
    parameters: int
    loop_is_reference: bool = False
    error: str | None = None
    location: Location | None = None


def weights_cast(o: WeightsCast) -> Finding:
    """`half-open-amp`: no fp32 master weights, so another precision trains (an error)."""
    dtype = o.dtypes[0].removeprefix("torch.")
    names = ", ".join(f"`{n}`" for n in o.names[:3])
    more = len(o.names) - 3
    names += f" and {more} more" if more > 0 else ""
    where = o.location
    code = (where.code or "").split("#", 1)[0].strip() if where is not None else ""
    call = f" (`{code}`, line {where.line})" if code and where is not None else ""
    if o.precision == "fp32":
        consequence = f"its 'fp32' baseline is really {dtype}"
        if o.loop_is_reference:
            consequence += (" (and the loop-as-reference, the same loop, is cast too: its "
                            "updates would match and prove nothing)")
    else:
        consequence = (f"the {o.precision} run trains {dtype} weights, not fp32 weights "
                       f"under autocast({'bfloat16' if o.precision == 'bf16' else 'float16'})")
    fp16 = (" GradScaler refuses to unscale fp16 gradients, and small updates round away in "
            "fp16 weights." if "torch.float16" in o.dtypes else
            " Small updates round away in low-precision weights.")
    error = f" The loop then raised {o.error.rstrip('.')}." if o.error is not None else ""
    return half_open_amp(Observed(o.rung, Severity.ERROR,
        f"The {o.precision} run cast the model's weights to {dtype}{call}: "
        f"{len(o.names)} of {o.parameters} trainable parameter tensor(s) ({names}) were "
        f"{dtype} when the loop returned, so the optimizer updates {dtype} weights with no fp32 "
        f"master copy and {consequence}.{fp16}{error} Keep the model in fp32 and let autocast "
        "make the low-precision compute: `with torch.autocast(run.device_type, "
        "dtype=run.autocast_dtype, enabled=run.autocast_dtype is not None):`.",
        evidence={"measured": ", ".join(d.removeprefix("torch.") for d in o.dtypes),
                  "expected": "float32", "parameters_cast": len(o.names),
                  "parameters": o.parameters, "cast": list(o.names[:10]),
                  "precision": o.precision},
        location=where))


@dataclass(frozen=True)
class AutocastInFp32:
    """The fp32 run entered an enabled autocast (the loop hard-codes its precision): the dtype,
    how often, and the first step that differs from the reference (None: every update
    matched)."""

    rung: str
    dtype: str
    entered: int
    step: int | None = None
    rel_err: float = 0.0
    ratio: float = 1.0
    cosine: float = 1.0
    tolerance: float = 0.0
    location: Location | None = None


def autocast_in_fp32(o: AutocastInFp32) -> Finding:
    """`half-open-amp` in the fp32 run: an error when an update differs from the reference (the
    autocast explains the mismatch), a warning while every update matched."""
    evidence: Evidence = {"measured": o.dtype, "expected": "no autocast",
                          "autocast_entered": o.entered}
    if o.step is not None:
        evidence.update({"step": o.step, "relative_error": significant(o.rel_err),
                         "ratio": significant(o.ratio), "cosine": significant(o.cosine),
                         "tolerance": o.tolerance})
        return half_open_amp(Observed(o.rung, Severity.ERROR,
            f"The fp32 run (run.autocast_dtype is None) entered autocast({o.dtype}) "
            f"{o.entered} time(s): the loop hard-codes its mixed precision, so its "
            f"'fp32' baseline is really {o.dtype}. Step {o.step} differs from the fp32 "
            f"reference by {o.rel_err:.3g} (relative; tolerance "
            f"{o.tolerance:g}, norm ratio {o.ratio:.4g}, cosine "
            f"{o.cosine:.5f}): rounding, not a factor.",
            evidence=evidence, location=o.location))
    return half_open_amp(Observed(o.rung, Severity.WARNING,
        f"The fp32 run entered autocast({o.dtype}) {o.entered} time(s) although "
        "run.autocast_dtype is None: the updates still matched the fp32 reference "
        "here, but the loop ignores the precision it is asked for.",
        evidence=evidence, location=o.location))
