"""Per-run series for the charts of the postmortem: for every run of the loop a rung judged
(or, for the skips rung, the injected-overflow run it checked), per optimizer step the
consumed/reference norm ratio with the tolerance band, and per window the loss scale, the
skipped flag and the gradient norm before and after unscale_. Scalars only, rounded: a record
stays a few KiB whatever the model."""

from __future__ import annotations

import math
from typing import Any

from .. import thresholds
from ..judge import Judgement
from ..probe.events import ScalerStep, Unscale, Update
from ..session import Session, Trace


def _num(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return round(number, 6) if math.isfinite(number) else None


def scaler_series(trace: Trace) -> dict[str, list[Any]]:
    """Per window of a run: the loss scale after each update(), whether scaler.step skipped,
    and the gradient norm before and after each enabled unscale_ (as the probe recorded them)."""
    unscales = [e for e in trace.events_of(Unscale) if e.enabled]
    return {
        "scale": [e.scale_after for e in trace.events_of(Update)],
        "grad_norm_before_unscale": [e.norm_before for e in unscales],
        "grad_norm_after_unscale": [e.norm_after for e in unscales],
        "skipped": [bool(e.skipped) for e in trace.events_of(ScalerStep)],
    }


def run_series(rung: str, trace: Trace, judgement: Judgement | None = None,
               label: str | None = None) -> dict[str, Any]:
    series: dict[str, Any] = {
        "rung": rung, "precision": trace.precision, "label": label or f"{trace.precision} run",
        **{key: values if key == "skipped" else [_num(v) for v in values]
           for key, values in scaler_series(trace).items()},
    }
    if judgement is not None:
        # The band is 1 +- rtol: a ratio outside it has a relative error above the tolerance
        # (||g - r|| / ||r|| >= | ||g|| / ||r|| - 1 |), inside it the direction decides. In
        # bf16/fp16 the judge also lets a step within thresholds.NOISE_RATIO_BAND pass as
        # rounding when its direction holds: `noise_band`. `bad` is the judge's own verdict per
        # step. (A clip that bit is judged on its pre-clip ratio within max(3 rtol, 1e-3) in fp32
        # and 0.25 in bf16, thresholds.PRECLIP_BAND_*: close to these bands, not drawn apart.)
        rtol = judgement.tolerance.rtol
        series.update({
            "step": [s.ordinal for s in judgement.steps],
            "ratio": [_num(r) for r in judgement.ratios()],
            "bad": [bool(s.bad) for s in judgement.steps],
            # the step's ratio is the norm a clip that bit saw over the unclipped reference's
            "preclip": [s.preclip_ratio is not None for s in judgement.steps],
            "band": [round(1 - rtol, 6), round(1 + rtol, 6)],
        })
        if judgement.precision != "fp32":
            series["noise_band"] = list(thresholds.NOISE_RATIO_BAND)
    return series


def keep(session: Session, series: dict[str, Any]) -> None:
    """Add a run's series to the session's (one per rung and run label)."""
    kept = session.charts
    kept[:] = [s for s in kept if (s["rung"], s["label"]) != (series["rung"], series["label"])]
    kept.append(series)
