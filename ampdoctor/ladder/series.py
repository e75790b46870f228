"""Per-run series for the charts of the postmortem: for every run of the loop a rung judged
(or, for the skips rung, the injected-overflow run it checked), per optimizer step the
consumed/reference norm ratio with the tolerance band, and per window the loss scale, the
skipped flag and the gradient norm before and after unscale_. Scalars only, rounded: a record
stays a few KiB whatever the model."""

from __future__ import annotations

import math
from typing import Any

from ..judge import Judgement
from ..session import Session, Trace


def _num(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return round(number, 6) if math.isfinite(number) else None


def run_series(rung: str, trace: Trace, judgement: Judgement | None = None,
               label: str | None = None) -> dict[str, Any]:
    unscales = [e for e in trace.of_kind("unscale") if e.enabled]
    series: dict[str, Any] = {
        "rung": rung, "precision": trace.precision, "label": label or f"{trace.precision} run",
        "scale": [_num(e.scale_after) for e in trace.of_kind("update")],
        "skipped": [bool(e.skipped) for e in trace.of_kind("scaler_step")],
        "grad_norm_before_unscale": [_num(e.norm_before) for e in unscales],
        "grad_norm_after_unscale": [_num(e.norm_after) for e in unscales],
    }
    if judgement is not None:
        # The band is 1 +- rtol: a ratio outside it has a relative error above the tolerance
        # (||g - r|| / ||r|| >= | ||g|| / ||r|| - 1 |), inside it the direction decides.
        rtol = judgement.tolerance.rtol
        series.update({
            "step": [s.ordinal for s in judgement.steps],
            "ratio": [_num(r) for r in judgement.ratios()],
            "bad": [bool(s.bad) for s in judgement.steps],
            "band": [round(1 - rtol, 6), round(1 + rtol, 6)],
        })
    return series


def keep(session: Session, series: dict[str, Any]) -> None:
    """Add a run's series to the session's (one per rung and run label)."""
    kept = getattr(session, "charts", None)
    if kept is None:
        return
    kept[:] = [s for s in kept if (s["rung"], s["label"]) != (series["rung"], series["label"])]
    kept.append(series)
