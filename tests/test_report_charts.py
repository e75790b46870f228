"""The postmortem's data: per-run chart series in the record (every judged run, a run failing
at fp32-accum included, and the skips rung's injected-overflow run), the user's source lines
kept at diagnose time, and the charts and snippets rendered from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ampdoctor.report.html import render_html
from conftest import CONFIGS, RECIPES, marked_line, run_cli


@pytest.fixture(scope="module")
def healthy_record(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("healthy")
    result = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--json", "--out", out)
    assert result.returncode == 0, result.stderr
    return result.record


def test_every_judged_run_has_its_series(healthy_record: dict) -> None:
    runs = {(r["rung"], r["label"]): r for r in healthy_record["runs"]}
    for rung, precision, rtol in (("fp32-accum", "fp32", 1e-3), ("bf16-no-scaler", "bf16", 0.1),
                                  ("fp16-scaler", "fp16", 0.05)):
        run = runs[(rung, f"{precision} run")]
        assert run["step"] == [0, 1, 2]
        assert all(abs(r - 1) <= rtol for r in run["ratio"]), run["ratio"]
        assert run["band"] == [pytest.approx(1 - rtol), pytest.approx(1 + rtol)]
        assert run["bad"] == [False, False, False]
    fp16 = runs[("fp16-scaler", "fp16 run")]
    assert fp16["scale"] == [65536.0] * 3
    # before unscale_ the norm is S times the true one
    for before, after in zip(fp16["grad_norm_before_unscale"], fp16["grad_norm_after_unscale"],
                             strict=True):
        assert before / after == pytest.approx(65536, rel=1e-3)
    injected = next(r for r in healthy_record["runs"] if r["rung"] == "skips")
    assert injected["label"] == "fp16 run, overflow injected in window 1"
    assert injected["skipped"] == [False, True, False]
    assert injected["scale"] == [65536.0, 32768.0, 32768.0]      # backed off once
    assert injected["grad_norm_after_unscale"][1] is None        # the inf window


def test_a_run_failing_at_fp32_accum_has_its_chart_and_source(tmp_path: Path) -> None:
    result = run_cli("diagnose", CONFIGS / "broken_missing_average.yaml", "--json", "--out",
                     tmp_path)
    assert result.returncode == 1
    record = result.record
    (run,) = [r for r in record["runs"] if r["rung"] == "fp32-accum"]
    assert run["ratio"] == [pytest.approx(4.0, rel=1e-3)] * 3      # K = 4 times the reference
    assert run["bad"][0] is True
    finding = record["findings"][0]
    line = marked_line(RECIPES / "broken_missing_average.py", "missing-accumulation-average")
    source = finding["source"]
    assert source["line"] == line and source["start"] == line - 3
    assert "# BUG: missing-accumulation-average" in source["lines"][line - source["start"]]
    assert len(source["lines"]) == 7
    page = render_html(record)
    assert page.count("<svg") == 1             # the ratio chart of the one run that ran
    assert "update applied / reference update" in page and "optimizer step" in page
    assert "ratio to the fp32 reference" in page
    assert 'class="hit"' in page
    # the terminal shows the same lines, the offending one marked
    text = run_cli("report", next(tmp_path.glob("*.json"))).stdout
    assert f">{line:5d} | " in text


def test_source_is_kept_as_it_was_at_diagnose_time(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "loop.py").write_text((RECIPES / "broken_missing_average.py").read_text())
    (project / "common.py").write_text((RECIPES / "common.py").read_text())
    spec = (CONFIGS / "broken_missing_average.yaml").read_text()
    spec = spec.replace("project_root: ../recipes", "project_root: .")
    spec = spec.replace("broken_missing_average:train_loop", "loop:train_loop")
    (project / "spec.yaml").write_text("\n".join(
        line for line in spec.splitlines() if "recipes/" not in line and "scan:" not in line))
    result = run_cli("diagnose", project / "spec.yaml", "--json", "--out", tmp_path / "runs",
                     "--rungs", "fp32-accum")
    assert result.returncode == 1, result.stderr
    (project / "loop.py").write_text("# rewritten after the run\n")
    saved = json.loads(next((tmp_path / "runs").glob("*.json")).read_text())
    assert any("BUG: missing-accumulation-average" in line
               for line in saved["findings"][0]["source"]["lines"])


def test_old_records_without_runs_still_chart_their_fp16_series() -> None:
    record = {"verdict": "healthy", "name": "old", "rungs": [], "findings": [],
              "series": {"scale": [1024.0, 512.0, 512.0], "skipped": [False, True, False],
                         "grad_norm_before_unscale": [900.0, None, 700.0],
                         "grad_norm_after_unscale": [0.9, None, 1.4]}}
    page = render_html(record)
    assert page.count("<svg") == 2             # scale and norms; no ratio without a judgement
    assert "loss scale S (log2)" in page and "step skipped (inf/NaN)" in page


def test_broken_series_in_a_record_do_not_break_the_page() -> None:
    record = {"verdict": "failed", "name": "hand-edited", "rungs": [], "findings": [],
              "runs": [{"rung": "fp16-scaler", "label": "x", "ratio": [1.0, float("nan")],
                        "step": [0], "band": [1.1, 0.9], "scale": [0.0, -1.0],
                        "skipped": [True]}]}
    page = render_html(record)
    assert "<h1>" in page and page.count("<svg") == 1


_SMALL = {"verdict": "failed", "name": "small", "rungs": [], "findings": [],
          "runs": [{"rung": "fp16-scaler", "precision": "fp16", "label": "fp16 run",
                    "step": [0, 1, 2], "ratio": [1.0, 4.0, 1.0], "bad": [False, True, False],
                    "band": [0.95, 1.05], "scale": [65536.0, 32768.0, 32768.0],
                    "skipped": [False, True, False],
                    "grad_norm_before_unscale": [6.0e4, None, 3.0e4],
                    "grad_norm_after_unscale": [0.9, None, 0.9]}]}


def _imports_after(*args: str) -> str:
    code = ("import sys\nfrom ampdoctor.cli import app\n"
            f"try:\n    app({list(args)!r})\nexcept SystemExit:\n    pass\n"
            "print('MODULES', 'torch' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def test_matplotlib_is_imported_only_for_the_html_page(tmp_path: Path) -> None:
    record = tmp_path / "r.json"
    record.write_text(json.dumps(_SMALL))
    assert _imports_after("--help") == "MODULES False False"
    assert _imports_after("report", str(record)) == "MODULES False False"
    page = tmp_path / "r.html"
    assert _imports_after("report", str(record), "--html", "-o", str(page)) \
        == "MODULES False True"
    assert page.read_text().count("<svg") == 3


def test_charts_are_deterministic_and_leave_rcparams_alone() -> None:
    import matplotlib
    before = dict(matplotlib.rcParams)
    first, second = render_html(_SMALL), render_html(_SMALL)
    assert first == second
    assert dict(matplotlib.rcParams) == before
    assert "<script" not in first and "<?xml" not in first and "<!DOCTYPE svg" not in first
    # axes, units and the band are on the ratio chart; the scale axis is log2
    for text in ("optimizer step", "update applied / reference update",
                 "ratio to the fp32 reference", "gradient L2 norm",
                 "tolerance band 0.95 to 1.05", "loss scale S (log2)", "step skipped (inf/NaN)",
                 "at unscale_, before it (x S)", "at unscale_, after it (true)"):
        assert text in first, text


def test_the_terminal_prints_an_errors_source_literally() -> None:
    from rich.console import Console

    from ampdoctor.report.terminal import render
    record = {"verdict": "error", "name": "e", "rungs": [], "findings": [],
              "error": {"type": "UserCodeError", "message": "the loop raised [bold]x[/]",
                        "location": {"file": "/tmp/loop.py", "line": 11},
                        "source": {"file": "/tmp/loop.py", "start": 10, "line": 11,
                                   "lines": ["x = 1", "raise ValueError('[red]boom[/]')",
                                             "y = 2"]}}}
    console = Console(record=True, width=120, color_system=None)
    render(record, console)
    text = console.export_text()
    assert "the loop raised [bold]x[/]" in text
    assert ">   11 | raise ValueError('[red]boom[/]')" in text
    assert "    10 | x = 1" in text


def test_the_noise_band_is_the_one_the_judge_accepts() -> None:
    from ampdoctor.core import thresholds
    from ampdoctor.maths import compare

    def noise(ratio: float) -> bool:
        m = compare.Metrics(rel_err=0.5, ratio=ratio, cosine=0.99, norm_user=ratio,
                            norm_ref=1.0, ok=False, allowed=0.1)
        return compare.is_precision_noise(m, "bf16")

    lo, hi = thresholds.NOISE_RATIO_BAND
    assert noise(lo) and noise(hi) and noise(1.0)
    assert not noise(lo * 0.99) and not noise(hi * 1.01)


def test_reduced_precision_runs_carry_their_noise_band(healthy_record: dict) -> None:
    bands = {r["precision"]: r.get("noise_band") for r in healthy_record["runs"]
             if r.get("ratio")}
    assert bands["fp32"] is None
    assert bands["bf16"] == [0.8, 1.25] and bands["fp16"] == [0.8, 1.25]
