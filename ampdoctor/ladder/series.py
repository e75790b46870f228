"""Per-run series for the charts of the postmortem: for every run of the loop a rung judged
(or, for the skips rung, the injected-overflow run it checked), per optimizer step the
consumed/reference norm ratio with the tolerance band, and per window the loss scale, the
skipped flag and the gradient norm before and after unscale_. Scalars only, rounded: a record
stays a few KiB whatever the model."""

from __future__ import annotations

import math
from typing import Any

from ..core import thresholds
from ..judge import Judgement
from ..judge.step import StepJudgement
from ..maths import compare
from ..probe.events import ScalerStep, Unscale, Update
from ..session import Session, Trace


def _num(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    # six significant digits, as a finding's evidence states them (a 1.5e-05 stays 1.5e-05)
    return compare._round(number) if math.isfinite(number) else None


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


def _seen(step: StepJudgement) -> float | None:
    """The norm the last clip that bit saw (the one `preclip_ratio` divides), if one bit."""
    if step.preclip_ratio is None:
        return None
    biting = [c for c in step.clips if c.bit]
    return biting[-1].seen_true_norm if biting else None


def _reference_norm(step: StepJudgement) -> float | None:
    """The reference's unclipped norm that `preclip_ratio` divides by."""
    seen = _seen(step)
    return seen / step.preclip_ratio if seen and step.preclip_ratio else None


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
            # what the step applied: the consumed update over the (clipped) reference's
            "update_ratio": [_num(s.metrics.ratio) for s in judgement.steps],
            # a clip that bit: the norm it saw (true space) and the reference's unclipped norm
            "clip_norm": [_num(_seen(s)) for s in judgement.steps],
            "reference_norm": [_num(_reference_norm(s)) for s in judgement.steps],
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
