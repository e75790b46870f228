"""Golden (snapshot) tests of what `ampdoctor report` shows: any change to how a record is
rendered, down to one word, fails here with a diff, and is seen in review with the golden file
that changes along with it.

Each committed record in tests/golden/ (`<name>.record.json`, produced once by the real
`ampdoctor diagnose --json` and normalised: tests/golden/make_records.py) is rendered through
the real CLI, in this process (no torch: `report` does not need it):

- `ampdoctor report RECORD` with NO_COLOR=1 and COLUMNS=100: `<name>.terminal.txt`. Output that
  is not a terminal (this test's, a CI log's) is laid out at COLUMNS (100 when unset), its
  summaries wrapped between words.
- `ampdoctor report RECORD --html -o FILE`: `<name>.html`, each chart's SVG replaced by a
  placeholder before the comparison (below).

To accept a rendering change on purpose, regenerate the golden files and review their diff:

    AMPDOCTOR_UPDATE_GOLDEN=1 pytest -n 0 tests/test_golden.py

Only that exact setting writes them (never on by default, and refused where CI is set); the
tests that wrote a file are reported as skipped, so an update run never passes for a check.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

GOLDEN = ROOT / "tests" / "golden"
NAMES = sorted(p.name.removesuffix(".record.json") for p in GOLDEN.glob("*.record.json"))
UPDATE_VARIABLE = "AMPDOCTOR_UPDATE_GOLDEN"

#: What user text must never bring raw into a rendering: C0 controls but newline and tab, DEL,
#: C1 controls, bidi formatting characters, line and paragraph separators.
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                 "\u2066-\u2069\u2028\u2029]")

#: A terminal rendering at a fixed width, without colour.
TERMINAL_ENV = {"NO_COLOR": "1", "COLUMNS": "100"}

#: matplotlib's inline SVG of a chart: its paths, glyphs and ids differ from one matplotlib (or
#: freetype) build to another, so the comparison sees a placeholder instead. The page around it
#: (which charts, in which order, with which caption) is still compared; the charts themselves
#: are tested in test_report_charts.py.
SVG = re.compile(r"<svg\b.*?</svg>", re.S)
SVG_PLACEHOLDER = "<svg><!-- chart: matplotlib's SVG, not compared --></svg>"


def _updating() -> bool:
    if os.environ.get(UPDATE_VARIABLE) != "1":
        return False
    if os.environ.get("CI"):
        pytest.fail(f"{UPDATE_VARIABLE}=1 rewrites the golden files: never in CI")
    return True


def _check(rendered: str, golden: Path) -> None:
    """`rendered` must be `golden`'s text; the unified diff says where it is not. Whatever the
    golden file says, the rendering holds no raw control or bidi character (a golden file
    regenerated from a renderer that lets one through would act on the reviewer's terminal)."""
    raw = sorted({f"U+{ord(c):04X}" for c in RAW.findall(rendered)})
    assert not raw, f"raw control or bidi characters in the rendering: {raw}"
    if _updating():
        golden.write_text(rendered, encoding="utf-8", newline="")
        pytest.skip(f"{UPDATE_VARIABLE}=1: wrote {golden.relative_to(ROOT)}")
    if not golden.exists():
        pytest.fail(f"no golden file {golden.relative_to(ROOT)}: create it with "
                    f"{UPDATE_VARIABLE}=1 pytest -n 0 tests/test_golden.py, and review it")
    expected = golden.read_bytes().decode("utf-8")     # as committed: no newline translation
    if rendered == expected:
        return
    diff = "".join(difflib.unified_diff(
        expected.splitlines(keepends=True), rendered.splitlines(keepends=True),
        fromfile=f"{golden.relative_to(ROOT)} (golden)", tofile="rendered now", n=2))
    # pytest.fail, not assert ==: the diff alone, not two long renderings side by side
    pytest.fail(f"the rendering differs from {golden.relative_to(ROOT)}; if the change is "
                f"meant, regenerate with {UPDATE_VARIABLE}=1 and review the diff.\n"
                f"{_first_difference(expected, rendered)}\n{diff}", pytrace=False)


def _first_difference(expected: str, rendered: str) -> str:
    """Where the first difference is, with a little text either side: a word changed in a
    panel changes its width, so every line of the panel is in the diff, some very long."""
    old, new = expected.splitlines(), rendered.splitlines()
    row = _first_unequal(old, new)
    a, b = (old[row] if row < len(old) else ""), (new[row] if row < len(new) else "")
    col = _first_unequal(a, b)
    start = max(0, col - 30)
    return (f"first difference: line {row + 1}, column {col + 1}:\n"
            f"  golden: {a[start:col + 40]!r}\n  now:    {b[start:col + 40]!r}")


def _first_unequal(a, b) -> int:
    """The first index where the two sequences differ (the shorter's length if one is the
    other's start)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def _html(page: str) -> str:
    """The page as compared: each chart's SVG a placeholder. Nothing else in the page is
    volatile: its date, host, versions and paths are the record's own (normalised when the
    record was made), and the page has no time of its own generation."""
    return SVG.sub(SVG_PLACEHOLDER, page)


def test_there_are_golden_records():
    assert set(NAMES) >= {"healthy", "failed_missing_average", "skipped_and_warning",
                          "loop_error", "hostile_text"}, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_terminal_report(name, tmp_path):
    # cwd: a folder unlike the checkout; the records hold relative paths, shown as they are
    result = run_cli("report", GOLDEN / f"{name}.record.json", env=TERMINAL_ENV, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    _check(result.stdout, GOLDEN / f"{name}.terminal.txt")


@pytest.mark.parametrize("name", NAMES)
def test_html_report(name, tmp_path):
    page = tmp_path / f"{name}.html"
    result = run_cli("report", GOLDEN / f"{name}.record.json", "--html", "-o", page,
                     env=TERMINAL_ENV, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    _check(_html(page.read_text(encoding="utf-8")), GOLDEN / f"{name}.html")
