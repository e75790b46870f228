"""The HTML postmortem's charts state the numbers the findings state.

For every broken sample config (one page per kind), the page's charts are read back from the
values it prints under each chart (the values the SVG is drawn from, `charts.Chart`), and the
failing finding's evidence is looked up there: the update the step applied over the reference
(`ratio`, or `ratio_after_clip` where a clip bit), the norm a clip saw over the reference's
(`measured` of a clip-before-unscale, `ratio` where a clip hid the factor), the norm the clip
saw and the reference's (`norm_seen_by_clip`, `true_norm`). Every chart names its axes.
"""

from __future__ import annotations

import html
import re

import pytest

from ampdoctor.report import charts
from ampdoctor.report.html import render_html
from conftest import CONFIGS

UPDATE = "update applied / reference update"
SEEN_RATIO = "norm a clip saw / reference norm (before clipping)"
SEEN_NORM = "norm a clip saw"
REFERENCE_NORM = "reference's norm (unclipped)"

#: every broken recipe's page (the DDP ones spawn ranks: slow, and their charts are the same)
PAGES = [pytest.param(p.stem, marks=[pytest.mark.xdist_group(p.stem)])
         for p in sorted(CONFIGS.glob("broken_*.yaml")) if "_ddp" not in p.stem]


def page_charts(page: str) -> dict[tuple[str, str], list[dict]]:
    """{(run label, rung): [{"axis": header, "steps": [...], "rows": {label: [cells]}}]}."""
    out: dict[tuple[str, str], list[dict]] = {}
    for section in re.findall(r'<section class="run">(.*?)</section>', page, re.S):
        head = re.search(r"<h3>(.*?) — rung ([\w-]+)", section)
        assert head, section[:200]
        tables = []
        for table in re.findall(r'<table class="chart-values">(.*?)</table>', section, re.S):
            header = [html.unescape(c) for c in re.findall(r"<th>(.*?)</th>", table)]
            rows = {}
            for row in re.findall(r"<tr><td>(.*?)</tr>", table.split("<tbody>")[1], re.S):
                cells = [html.unescape(c) for c in re.findall(r"(?:^|<td>)(.*?)</td>", row)]
                rows[cells[0]] = cells[1:]
            tables.append({"axis": header[0], "steps": [int(s) for s in header[1:]],
                           "rows": rows})
        out[(html.unescape(head.group(1)), head.group(2))] = tables
    return out


def plotted(tables: list[dict], series: str, step: int) -> str | None:
    for table in tables:
        if series in table["rows"] and step in table["steps"]:
            return table["rows"][series][table["steps"].index(step)] or None
    return None


def _g(value: float) -> str:
    return f"{float(value):.4g}"


@pytest.mark.parametrize("name", PAGES)
def test_each_kinds_page_plots_the_numbers_its_finding_states(name, diagnosed):
    record = diagnosed(name).record
    page = render_html(record)
    shown = page_charts(page)
    for tables in shown.values():
        for table in tables:
            ylabel, _, xlabel = table["axis"].rpartition(" / ")
            assert ylabel and xlabel == "optimizer step", table["axis"]
            assert all(label for label in table["rows"])
    # the page's values are the record's series, as drawn
    for run in record.get("runs") or []:
        for make in (charts.ratio_data, charts.scale_data, charts.norm_data):
            chart = make(run)
            if chart is None:
                continue
            steps, rows = charts.values_table(chart)
            (tables,) = [t for (label, rung), t in shown.items()
                         if (label, rung) == (run["label"], run["rung"])]
            table = next(t for t in tables if t["axis"].startswith(chart.ylabel.split("\n")[0]))
            assert table["steps"] == steps
            assert table["rows"] == dict(rows)

    findings = sorted(record["findings"], key=lambda f: f["severity"] != "error")
    if not findings:
        return
    finding = findings[0]
    evidence = finding["evidence"]
    runs = [(label, rung) for (label, rung) in shown if rung == finding["rung"]]
    if "step" not in evidence or not runs:
        return      # a finding of no single step (a count, a scale state), or no judged run
    precision = evidence.get("precision")
    key = next((k for k in runs if precision is None or k[0] == f"{precision} run"), runs[0])
    tables, step = shown[key], evidence["step"]
    checks = []
    if "ratio_after_clip" in evidence:        # a clip bit and hid the factor
        checks += [(UPDATE, evidence["ratio_after_clip"]), (SEEN_RATIO, evidence["ratio"])]
    elif "ratio" in evidence:
        checks.append((UPDATE, evidence["ratio"]))
    if "norm_seen_by_clip" in evidence:
        checks += [(SEEN_RATIO, evidence["measured"]), (SEEN_NORM, evidence["norm_seen_by_clip"]),
                   (REFERENCE_NORM, evidence["true_norm"])]
    assert checks, evidence
    for series, value in checks:
        assert plotted(tables, series, step) == _g(value), (series, step, value, tables)


def test_clip_before_unscale_plots_the_update_its_text_states(diagnosed):
    """The report that plotted ~65,546 where the text said 'update 1.586e-05x reference'."""
    record = diagnosed("broken_clip_before_unscale").record
    finding = record["findings"][0]
    assert finding["kind"] == "clip-before-unscale"
    stated = re.search(r"the update is (\S+)x the reference", finding["message"]).group(1)
    shown = page_charts(render_html(record))
    tables = shown[("fp16 run", "fp16-scaler")]
    step = finding["evidence"]["step"]
    assert plotted(tables, UPDATE, step) == stated
    # the scaled norm the clip saw is on its own series, labelled as what it is
    ring = float(plotted(tables, SEEN_RATIO, step))
    assert ring == pytest.approx(finding["evidence"]["scale"], rel=0.2)
    assert float(plotted(tables, UPDATE, step)) < 1e-3
