"""`ampdoctor report --html`: a self-contained HTML postmortem (jinja2, inline CSS, and
matplotlib charts as inline SVG: one file a reviewer can attach to a postmortem, no script, no
external load). matplotlib is imported only when a page is rendered.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader
from markupsafe import Markup

from ..core.safetext import FIELD_LIMIT, TRACEBACK_LIMIT, inert
from ..record import as_record, atomic_write_text
from ..record.model import RecordModel, RunSeriesModel

#: The statuses, severities and verdicts the stylesheet knows.
CSS_CLASSES = {"pass", "fail", "warn", "skip", "not-run", "error", "warning", "healthy", "failed",
               "inconclusive"}


def _visible(value: Any) -> Any:
    """Every `{{ value }}` of the page, before jinja escapes it: the record's text with its
    control and bidi characters shown as escapes (`safetext.inert`), newlines kept (a
    traceback, a message in <pre>), cut to `TRACEBACK_LIMIT` characters with a note (a record
    written before messages were cut). Markup (the charts' SVG, a macro's output) is the
    page's own; numbers and None print as they are."""
    if isinstance(value, Markup) or value is None or isinstance(value, (bool, int, float)):
        return value
    return inert(value, limit=TRACEBACK_LIMIT)


def _oneline(value: Any) -> str:
    """One line of text (the <title>, the heading): newlines and tabs shown as escapes too."""
    return inert("" if value is None else value, limit=FIELD_LIMIT, multiline=False)


def _css(value: Any) -> str:
    """Class names come from a fixed set, never from the record's text."""
    return value if isinstance(value, str) and value in CSS_CLASSES else "unknown"


def render_html(record: RecordModel | Mapping[str, Any]) -> str:
    """The page of a record (its JSON data is read as one: `record.as_record`)."""
    record = as_record(record)
    # Every value from the record is escaped, whatever the template's name: a spec name, a
    # path or an exception message is text, never markup (select_autoescape(["html"]) would
    # not match `report.html.j2`); and `finalize` makes every value's control characters
    # visible first (HTML escaping leaves ESC, NUL and U+202E as they are).
    env = Environment(loader=PackageLoader("ampdoctor.report", "templates"), autoescape=True,
                      finalize=_visible)
    env.filters["css"] = _css
    env.filters["oneline"] = _oneline
    from .charts import run_charts, values_table
    runs = record.runs
    series = record.series
    if not runs and (series.scale or series.grad_norm_after_unscale):
        # a record from before per-run series: its fp16 series alone
        runs = [RunSeriesModel.model_validate({"rung": "fp16-scaler", "precision": "fp16",
                                               "label": "fp16 run", **series.dump(filled=True)})]
    charted = run_charts(runs)
    # the run the failed rung judged comes first: what a postmortem reader looks for
    charted.sort(key=lambda run: run["rung"] != record.failed_rung)
    for run in charted:
        # matplotlib's SVG: numbers and fixed labels only (charts.py), so it is markup
        run["charts"] = [{"title": chart.title, "xlabel": chart.xlabel.replace("\n", " "),
                          "ylabel": chart.ylabel.replace("\n", " "), "svg": Markup(svg),
                          "values": values_table(chart)} for chart, svg in run["charts"]]
    template = env.get_template("report.html.j2")
    return template.render(record=record, runs=charted)


def write_html(record: RecordModel | Mapping[str, Any], target: Path) -> Path:
    """Write atomically: a reader never sees half a report."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, render_html(record))
    return target
