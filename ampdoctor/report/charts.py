"""The postmortem's charts: matplotlib figures rendered to inline SVG (Agg, no display).

Per judged run: the update each optimizer step applied over the fp32 reference's (and, where a
clip bit, the norm the clip saw over the reference's unclipped norm) with the tolerance band;
for runs with an enabled GradScaler, the loss scale on a log axis with the skipped steps
marked; and the gradient norms: the one a clip saw, the reference's, and the norm at unscale_
before and after it. Each chart is first a `Chart` (what it plots, under which labels): the
SVG is drawn from it and the page prints the same values under the chart, so a number the
chart shows is the number the finding's text states. Nothing from the record's text is drawn:
titles and labels are fixed strings (the page shows the run's label as escaped HTML), the
numbers are numbers. matplotlib is imported only here, only for --html.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core import thresholds

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.typing import RcKeyType

    from ..record.model import RunSeriesModel

#: one style for every chart
BLUE, RED, GREY, GREEN = "#2563eb", "#b91c1c", "#6b7280", "#15803d"


def _finite(values: list[Any]) -> list[tuple[int, float]]:
    return [(i, float(v)) for i, v in enumerate(values)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


#: matplotlib settings for the charts, applied only while a chart is drawn and saved
#: (`rc_context`): a notebook that renders a page keeps its own rcParams. `svg.hashsalt` makes
#: the SVG ids the same from one render to the next (a page is deterministic, diffable).
RC: dict[RcKeyType, Any] = {"svg.fonttype": "none", "svg.hashsalt": "ampdoctor", "font.size": 9}


def _agg() -> None:
    """The CLI draws without a display: Agg. A process that already imported pyplot keeps its
    backend (switching would close its figures); the charts never use pyplot anyway."""
    import sys

    import matplotlib
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")


def _figure() -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    fig = Figure(figsize=(7.6, 2.5))
    ax = fig.add_subplot()
    ax.grid(True, color="#e5e7eb", linewidth=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def _legend(ax: Axes) -> None:
    """Beside the axes, never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
              borderaxespad=0.0)


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]            # no XML prolog or DOCTYPE inside HTML
    # no scripts or links can come from matplotlib, but keep the contract explicit
    text = re.sub(r"<script.*?</script>|<metadata>.*?</metadata>", "", text, flags=re.S)
    return text


@dataclass(frozen=True)
class Series:
    """One plotted series: its legend label and its (optimizer step, value) points. `style`:
    "line", "steps" (a step line), "ring" (hollow markers), "cross" or "skip" (markers)."""

    label: str
    points: tuple[tuple[int, float], ...]
    style: str = "line"
    color: str = BLUE
    marker: str = "o"


@dataclass(frozen=True)
class Chart:
    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    bands: tuple[tuple[str, float, float, str, float], ...] = ()  # label, low, high, color, alpha
    reference_line: float | None = None
    yscale: str = "linear"          # "linear", "log" or "log2"
    notes: tuple[str, ...] = field(default_factory=tuple)


def ratio_data(run: RunSeriesModel | Mapping[str, Any]) -> Chart | None:
    """The update each step applied over the reference's; a clip that bit adds the norm it
    saw over the reference's unclipped norm (where the factor of the bug shows). A record from
    before `update_ratio` has only `ratio`: the pre-clip ratio where a clip bit."""
    run = as_run(run)
    ratios = run.ratio
    preclip = run.preclip
    update = run.update_ratio
    steps = run.step
    bad = run.bad
    applied, seen, flagged = [], [], []
    for i in range(max(len(ratios), len(update))):
        x = steps[i] if i < len(steps) and isinstance(steps[i], int) else i
        clipped = i < len(preclip) and preclip[i] is True
        ratio = ratios[i] if i < len(ratios) and _finite([ratios[i]]) else None
        if update:
            applied_value = update[i] if i < len(update) and _finite([update[i]]) else None
        else:
            applied_value = None if clipped else ratio
        point_applied = (x, float(applied_value)) if applied_value is not None else None
        point_seen = (x, float(ratio)) if clipped and ratio is not None else None
        if point_applied:
            applied.append(point_applied)
        if point_seen:
            seen.append(point_seen)
        # a bad step is marked on its update, unless the update is in the band and the judge
        # found it bad on the norm a clip saw (the clip hid the factor)
        mark = point_applied
        if point_seen and (mark is None or _in_band(run, mark[1])):
            mark = point_seen
        if i < len(bad) and bad[i] and mark:
            flagged.append(mark)
    if not applied and not seen:
        return None
    series = []
    if applied:
        series.append(Series("update applied / reference update", tuple(applied)))
    if seen:
        series.append(Series("norm a clip saw / reference norm\n(before clipping)", tuple(seen),
                             style="ring", color=GREY))
    if flagged:
        series.append(Series("judged bad", tuple(flagged), style="cross", color=RED, marker="x"))
    bands = []
    band = run.band
    if len(band) == 2 and all(_number(b) for b in band):
        bands.append((f"tolerance band {band[0]:g} to {band[1]:g}", band[0], band[1], GREEN, 0.15))
    noise = run.noise_band
    if len(noise) == 2 and all(_number(b) for b in noise):
        bands.append((f"precision noise if cosine >= {thresholds.NOISE_MIN_COSINE:g}:\n"
                      f"{noise[0]:g} to {noise[1]:g}", noise[0], noise[1], GREY, 0.08))
    span = [v for _, v in applied + seen] + [1.0]   # the reference line is on the chart too
    log = min(span) > 0 and max(span) / min(span) > 20
    return Chart("update per optimizer step, over the fp32 reference's", "optimizer step",
                 "ratio to the fp32 reference\n(1.0 is right)", tuple(series), tuple(bands),
                 reference_line=1.0, yscale="log" if log else "linear")


def _in_band(run: RunSeriesModel, value: float) -> bool:
    band = run.band
    return len(band) == 2 and all(_number(b) for b in band) and band[0] <= value <= band[1]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at_steps(run: RunSeriesModel, values: list[Any]) -> list[tuple[int, float]]:
    """(the step's ordinal, value) for every finite value of a per-step series."""
    steps = run.step
    return [(steps[i] if i < len(steps) and isinstance(steps[i], int) else i, v)
            for i, v in _finite(values)]


def scale_data(run: RunSeriesModel | Mapping[str, Any]) -> Chart | None:
    run = as_run(run)
    scale = [(i, v) for i, v in _finite(run.scale) if v > 0]
    if not scale:
        return None
    series = [Series("loss scale after update()", tuple(scale), style="steps")]
    skipped = run.skipped
    values = dict(scale)
    marks = [(i, values.get(i, scale[0][1])) for i, s in enumerate(skipped) if s]
    if marks:
        series.append(Series("step skipped (inf/NaN)", tuple(marks), style="skip", color=RED,
                             marker="v"))
    return Chart("loss scale, skipped steps marked", "optimizer step", "loss scale S (log2)",
                 tuple(series), yscale="log2")


def norm_data(run: RunSeriesModel | Mapping[str, Any]) -> Chart | None:
    """Gradient L2 norms: the one a clip that bit saw (in true space when it knew the scale,
    else in the space it clipped in) and the reference's unclipped one, per step; and the norm
    at each unscale_, before it (still x S) and after it."""
    run = as_run(run)
    series = []
    for key, label, color, marker in (
            ("clip_norm", "norm a clip saw", GREY, "D"),
            ("reference_norm", "reference's norm (unclipped)", GREEN, "^")):
        points = [(x, v) for x, v in _at_steps(run, getattr(run, key)) if v > 0]
        if points:
            series.append(Series(label, tuple(points), color=color, marker=marker))
    for key, label, color, marker in (
            ("grad_norm_before_unscale", "at unscale_, before it (x S)", RED, "o"),
            ("grad_norm_after_unscale", "at unscale_, after it (true)", BLUE, "s")):
        points = [(i, v) for i, v in _finite(getattr(run, key)) if v > 0]
        if points:
            series.append(Series(label, tuple(points), color=color, marker=marker))
    if not series:
        return None
    return Chart("gradient norms: what a clip saw, the reference's, at unscale_",
                 "optimizer step", "gradient L2 norm (log)", tuple(series), yscale="log")


def draw(chart: Chart) -> str:
    """The chart as SVG: exactly its series, bands and labels."""
    fig, ax = _figure()
    for label, low, high, color, alpha in chart.bands:
        ax.axhspan(low, high, color=color, alpha=alpha, label=label)
    if chart.reference_line is not None:
        ax.axhline(chart.reference_line, color=GREEN, linewidth=0.8, linestyle="--",
                   label=f"reference ({chart.reference_line:g})")
    for s in chart.series:
        xs, ys = [p[0] for p in s.points], [p[1] for p in s.points]
        if s.style == "ring":
            ax.scatter(xs, ys, marker="o", s=110, facecolors="none", edgecolors=s.color,
                       zorder=3, label=s.label)
        elif s.style in ("cross", "skip"):
            ax.scatter(xs, ys, marker=s.marker, color=s.color, s=60 if s.style == "cross" else 70,
                       zorder=3, label=s.label)
        else:
            steps: dict[str, Any] = {"drawstyle": "steps-post"} if s.style == "steps" else {}
            ax.plot(xs, ys, marker=s.marker, color=s.color, linewidth=1.4, label=s.label,
                    **steps)
    if chart.yscale == "log2":
        ax.set_yscale("log", base=2)
    elif chart.yscale == "log":
        ax.set_yscale("log")
    ax.set_xlabel(chart.xlabel)
    ax.set_ylabel(chart.ylabel)
    _legend(ax)
    return _svg(fig)


def values_table(chart: Chart) -> tuple[list[int], list[tuple[str, list[str]]]]:
    """What the page prints under a chart: the steps, and each series' value at each step as a
    finding's text formats a number (4 significant digits; "" where it has none)."""
    steps = sorted({x for s in chart.series for x, _ in s.points})
    rows = []
    for s in chart.series:
        at = dict(s.points)
        rows.append((s.label.replace("\n", " "),
                     [f"{at[x]:.4g}" if x in at else "" for x in steps]))
    return steps, rows


def as_run(run: RunSeriesModel | Mapping[str, Any]) -> RunSeriesModel:
    """A run's series as the model (a record's JSON data for one is validated)."""
    from ..record.model import RunSeriesModel
    return run if isinstance(run, RunSeriesModel) else RunSeriesModel.model_validate(run)


def run_charts(runs: list[RunSeriesModel]) -> list[dict[str, Any]]:
    """For each run: its rung, label and the charts it has ([(Chart, svg)])."""
    _agg()
    import matplotlib
    with matplotlib.rc_context(RC):
        return [chart for run in runs if (chart := _run_charts(run))]


def _run_charts(run: RunSeriesModel) -> dict[str, Any] | None:
    charts = []
    for make in (ratio_data, scale_data, norm_data):
        try:
            chart = make(run)
            svg = draw(chart) if chart is not None else None
        except (ValueError, TypeError, OverflowError):   # a hand-edited record
            chart, svg = None, None
        if chart is not None and svg:
            charts.append((chart, svg))
    if not charts:
        return None
    return {"rung": run.rung, "label": run.label, "charts": charts}
