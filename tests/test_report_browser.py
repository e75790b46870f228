"""The postmortem page in a real headless browser: diagnose, `report --html`, then read the DOM
Chromium built -- the verdict, the kind, the file:line, the source lines and the charts with
their axes are on the page a reviewer opens."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import CONFIGS, RECIPES, marked_line, run_cli


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


pytestmark = pytest.mark.skipif(_chromium() is None, reason="no headless Chromium on this "
                                "machine (.ci/run installs Debian's chromium)")


class _Dom(HTMLParser):
    """The elements Chromium serialised: tag counts, text by class, the svg texts."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.stack: list[tuple[str, str]] = []
        self.text_in: dict[str, list[str]] = {}
        self.svg_text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.counts[tag] = self.counts.get(tag, 0) + 1
        self.stack.append((tag, dict(attrs).get("class") or ""))

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _tag, cls in self.stack:
            for name in cls.split():
                self.text_in.setdefault(name, []).append(data)
        if any(tag == "svg" for tag, _ in self.stack) and data.strip():
            self.svg_text.append(data.strip())


def _page(config: Path, tmp_path: Path, *extra: str) -> _Dom:
    runs = tmp_path / "runs"
    run_cli("diagnose", config, "--out", runs, *extra)
    record = max(runs.glob("*.json"))
    page = tmp_path / "page.html"
    assert run_cli("report", record, "--html", "-o", page).returncode == 0
    profile = tmp_path / "profile"
    dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                          "--disable-background-networking", "--disable-component-update",
                          "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                          "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    parsed = _Dom()
    parsed.feed(dom)
    return parsed


def test_a_failed_page_shows_the_diagnosis_source_and_charts(tmp_path: Path) -> None:
    dom = _page(CONFIGS / "broken_clip_before_unscale.yaml", tmp_path)
    line = marked_line(RECIPES / "broken_clip_before_unscale.py", "clip-before-unscale")
    assert "FAILED" in "".join(dom.text_in["verdict-failed"])
    finding = " ".join(dom.text_in["finding"])
    assert "error: clip-before-unscale" in finding and "[fp16-scaler]" in finding
    assert f"broken_clip_before_unscale.py:{line}" in " ".join(dom.text_in["where"])
    # the source lines around it, the offending one highlighted
    hit = " ".join(dom.text_in["hit"])
    assert str(line) in hit and "clip_grad_norm_" in hit
    assert len(dom.text_in["source"]) >= 5
    # one chart per figure of the runs that ran (fp32, bf16: ratio; fp16: ratio, scale, norms)
    assert dom.counts.get("svg") == 5 and dom.counts.get("figure") == 5
    for axis in ("optimizer step", "loss scale S (log2)", "gradient L2 norm (log)"):
        assert axis in dom.svg_text, axis
    assert any("tolerance band" in t for t in dom.svg_text)
    assert dom.counts.get("script", 0) == 0


def test_a_healthy_page_charts_the_injected_overflow(tmp_path: Path) -> None:
    dom = _page(CONFIGS / "healthy_sgd.yaml", tmp_path)
    assert "HEALTHY" in "".join(dom.text_in["verdict-healthy"])
    runs = " ".join(dom.text_in["run"])
    assert "fp16 run, overflow injected in window 1" in runs
    assert "step skipped (inf/NaN)" in dom.svg_text
    assert dom.counts.get("figure", 0) >= 7


def test_an_error_page_shows_the_users_line_and_traceback(tmp_path: Path) -> None:
    dom = _page(CONFIGS / "bad" / "factory_raises.yaml", tmp_path)
    assert "ERROR" in "".join(dom.text_in["verdict-error"])
    hit = " ".join(dom.text_in["hit"])
    assert "raise ValueError" in hit
    assert dom.counts.get("details", 0) >= 2          # the spec and the traceback
    assert dom.counts.get("svg", 0) == 0
