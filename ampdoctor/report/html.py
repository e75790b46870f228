"""`ampdoctor report --html`: a self-contained HTML postmortem (jinja2, inline CSS and SVG).

Charts are small inline SVG polylines drawn here rather than matplotlib: the report must render
without torch or a plotting stack, and stay one file a reviewer can attach to a postmortem.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..record import atomic_write_text
from jinja2 import Environment, PackageLoader
from markupsafe import Markup


def _svg_series(values: list[Any], *, log: bool = False, width: int = 420,
                height: int = 120) -> str:
    points = [(i, float(v)) for i, v in enumerate(values)
              if isinstance(v, (int, float)) and math.isfinite(float(v)) and (not log or v > 0)]
    if not points:
        return ""
    ys = [math.log2(v) if log else v for _, v in points]
    lo, hi = min(ys), max(ys)
    span = (hi - lo) or 1.0
    n = max(len(values) - 1, 1)
    coords = " ".join(f"{8 + (width - 16) * i / n:.1f},{height - 8 - (height - 16) * (y - lo) / span:.1f}"
                      for (i, _), y in zip(points, ys))
    dots = "".join(f'<circle cx="{c.split(",")[0]}" cy="{c.split(",")[1]}" r="2.5"/>'
                   for c in coords.split())
    # numbers only, formatted here: nothing from the record reaches the markup as text
    return Markup(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'class="chart"><polyline fill="none" stroke="#2563eb" stroke-width="1.5" '
            f'points="{coords}"/><g fill="#2563eb">{dots}</g></svg>')


#: The statuses, severities and verdicts the stylesheet knows.
CSS_CLASSES = {"pass", "fail", "warn", "skip", "not-run", "error", "warning", "healthy", "failed"}


def render_html(record: dict[str, Any]) -> str:
    # Every value from the record is escaped, whatever the template's name: a spec name, a
    # path or an exception message is text, never markup (select_autoescape(["html"]) would
    # not match `report.html.j2`).
    env = Environment(loader=PackageLoader("ampdoctor.report", "templates"), autoescape=True)
    # class names come from a fixed set, never from the record's text
    env.filters["css"] = lambda value: value if value in CSS_CLASSES else "unknown"
    series = record.get("series", {})
    charts = []
    if series.get("scale"):
        charts.append(("loss scale after each update (log2 axis)", _svg_series(series["scale"], log=True)))
    if series.get("grad_norm_after_unscale"):
        charts.append(("gradient norm after unscale_", _svg_series(series["grad_norm_after_unscale"])))
    if series.get("grad_norm_before_unscale"):
        charts.append(("gradient norm before unscale_ (scaled)",
                       _svg_series(series["grad_norm_before_unscale"], log=True)))
    template = env.get_template("report.html.j2")
    return template.render(record=record, charts=[c for c in charts if c[1]],
                           skipped=series.get("skipped", []))


def write_html(record: dict[str, Any], target: Path) -> Path:
    """Write atomically: a reader never sees half a report."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, render_html(record))
    return target
