"""The postmortem's charts: matplotlib figures rendered to inline SVG (Agg, no display).

Per judged run: the consumed/reference gradient-norm ratio of every optimizer step with the
tolerance band; for runs with an enabled GradScaler, the loss scale on a log axis with the
skipped steps marked, and the gradient norm before and after unscale_. Nothing from the
record's text is drawn: titles and labels are fixed strings (the page shows the run's label as
escaped HTML), the numbers are numbers. matplotlib is imported only here, only for --html.
"""

from __future__ import annotations

import io
import math
import re
from typing import TYPE_CHECKING, Any

from .. import thresholds

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

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


def _figure():
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    fig = Figure(figsize=(7.6, 2.5))
    ax = fig.add_subplot()
    ax.grid(True, color="#e5e7eb", linewidth=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def _legend(ax) -> None:
    """Beside the axes, never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
              borderaxespad=0.0)


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]            # no XML prolog or DOCTYPE inside HTML
    # no scripts or links can come from matplotlib, but keep the contract explicit
    text = re.sub(r"<script.*?</script>|<metadata>.*?</metadata>", "", text, flags=re.S)
    return text


def ratio_chart(run: dict[str, Any]) -> str | None:
    ratios = run.get("ratio") or []
    steps = run.get("step") or list(range(len(ratios)))
    points = [(steps[i] if i < len(steps) else i, v) for i, v in _finite(ratios)]
    if not points:
        return None
    fig, ax = _figure()
    band = run.get("band") or []
    if len(band) == 2 and all(isinstance(b, (int, float)) for b in band):
        ax.axhspan(band[0], band[1], color=GREEN, alpha=0.15,
                   label=f"tolerance band {band[0]:g} to {band[1]:g}")
    noise = run.get("noise_band") or []
    if len(noise) == 2 and all(isinstance(b, (int, float)) for b in noise):
        ax.axhspan(noise[0], noise[1], color=GREY, alpha=0.08,
                   label=f"precision noise if cosine >= {thresholds.NOISE_MIN_COSINE:g}:\n"
                         f"{noise[0]:g} to {noise[1]:g}")
    ax.axhline(1.0, color=GREEN, linewidth=0.8, linestyle="--", label="reference (1.0)")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ax.plot(xs, ys, marker="o", color=BLUE, linewidth=1.4, label="consumed / reference")
    preclip = run.get("preclip") or []
    clipped = [(x, y) for (i, y), x in zip(_finite(ratios), xs, strict=True)
               if i < len(preclip) and preclip[i] is True]
    if clipped:
        ax.scatter([p[0] for p in clipped], [p[1] for p in clipped], marker="o", s=110,
                   facecolors="none", edgecolors=GREY, zorder=3,
                   label="norm a clip saw, before clipping")
    bad = run.get("bad") or []
    flagged = [(x, y) for (i, y), x in zip(_finite(ratios), xs, strict=True)
               if i < len(bad) and bad[i]]
    if flagged:
        ax.scatter([p[0] for p in flagged], [p[1] for p in flagged], marker="x", color=RED,
                   s=60, zorder=3, label="judged bad")
    span = ys + [1.0]   # the reference line is on the chart too
    if min(span) > 0 and max(span) / min(span) > 20:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("consumed / reference\ngradient norm")
    _legend(ax)
    return _svg(fig)


def scale_chart(run: dict[str, Any]) -> str | None:
    scale = _finite(run.get("scale") or [])
    scale = [(i, v) for i, v in scale if v > 0]
    if not scale:
        return None
    fig, ax = _figure()
    ax.plot([i for i, _ in scale], [v for _, v in scale], marker="o", color=BLUE,
            drawstyle="steps-post", linewidth=1.4, label="loss scale after update()")
    ax.set_yscale("log", base=2)
    skipped = run.get("skipped") or []
    values = dict(scale)
    marks = [(i, values.get(i, scale[0][1])) for i, s in enumerate(skipped) if s]
    if marks:
        ax.scatter([i for i, _ in marks], [v for _, v in marks], marker="v", color=RED, s=70,
                   zorder=3, label="step skipped (inf/NaN)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale S (log2)")
    _legend(ax)
    return _svg(fig)


def norm_chart(run: dict[str, Any]) -> str | None:
    before = [(i, v) for i, v in _finite(run.get("grad_norm_before_unscale") or []) if v > 0]
    after = [(i, v) for i, v in _finite(run.get("grad_norm_after_unscale") or []) if v > 0]
    if not before and not after:
        return None
    fig, ax = _figure()
    if before:
        ax.plot([i for i, _ in before], [v for _, v in before], marker="o", color=RED,
                linewidth=1.2, label="before unscale_ (scaled: x S)")
    if after:
        ax.plot([i for i, _ in after], [v for _, v in after], marker="s", color=BLUE,
                linewidth=1.2, label="after unscale_ (true)")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient L2 norm (log)")
    _legend(ax)
    return _svg(fig)


def run_charts(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each run: its rung, label and the charts it has ([(title, svg)])."""
    _agg()
    import matplotlib
    with matplotlib.rc_context(RC):
        return [chart for run in runs if (chart := _run_charts(run))]


def _run_charts(run: dict[str, Any]) -> dict[str, Any] | None:
    charts = []
    for title, make in (("consumed / reference gradient per optimizer step", ratio_chart),
                        ("loss scale, skipped steps marked", scale_chart),
                        ("gradient norm before and after unscale_", norm_chart)):
        try:
            svg = make(run)
        except (ValueError, TypeError, OverflowError):   # a hand-edited record
            svg = None
        if svg:
            charts.append((title, svg))
    if not charts:
        return None
    return {"rung": run.get("rung", ""), "label": run.get("label", ""), "charts": charts}
