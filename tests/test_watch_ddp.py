"""`ampdoctor.watch` on a DistributedDataParallel loop: 2 real gloo ranks on CPU under torchrun
(`recipes/watch/ddp_loop.py`). Each rank checks the gradient its optimizer consumed (after the
all-reduce) against the mean of the ranks' fp32 replays; the findings of all ranks end in one
record, written once, by rank 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampdoctor.ddp.launch import free_port
from conftest import RECIPES, marked_line, run_cli_process

LOOP = RECIPES / "watch" / "ddp_loop.py"


def _torchrun(bug: str, tmp_path: Path, precision: str = "fp32") -> tuple[list[dict], list[Path]]:
    out, result = tmp_path / "out", tmp_path / "result"
    out.mkdir()
    result.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(LOOP),
         "--bug", bug, "--out", str(out), "--result", str(result), "--precision", precision],
        capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((result / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, sorted(out.glob("*.json"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_healthy_ddp_loop_is_silent_and_unchanged(tmp_path, precision):
    ranks, saved = _torchrun("none", tmp_path, precision)
    for rank in ranks:
        record = rank["record"]
        assert rank["identical"]                       # weights bit-identical, unwatched
        assert record["verdict"] == "healthy" and record["findings"] == []
        checked = record["watch"]["checked"]
        # the ranks' shards differ: only the mean of their replays matches what DDP consumed
        tolerance = {"fp32": 1e-5, "bf16": 0.02}[precision]
        assert len(checked) == 3 and all(c["ok"] and c["precision"] == precision
                                         and c["ratio"] == pytest.approx(1.0, abs=tolerance)
                                         for c in checked)
        assert record["watch"]["world_size"] == 2 and record["watch"]["gathered"]
    assert len(saved) == 1                             # one record, rank 0's


@pytest.mark.slow
def test_a_missing_average_is_named_once_with_its_ratio_and_line(tmp_path):
    ranks, saved = _torchrun("missing-accumulation-average", tmp_path)
    assert len(saved) == 1
    record = json.loads(saved[0].read_text())
    assert record["verdict"] == "failed" and record["exit_code"] == 1
    assert [f["kind"] for f in record["findings"]] == ["missing-accumulation-average"]
    finding = record["findings"][0]
    assert finding["evidence"]["measured"] == pytest.approx(4.0, rel=1e-4)
    assert finding["evidence"]["rank"] == [0, 1] and finding["evidence"]["world_size"] == 2
    assert finding["location"]["line"] == marked_line(LOOP, "missing-accumulation-average")
    assert "on each of 2 DDP ranks" in record["rungs"][0]["summary"]
    assert all(r["identical"] for r in ranks)
    # every rank holds the same findings; the saved one renders
    assert ranks[1]["record"]["findings"] == record["findings"]
    proc = run_cli_process("report", saved[0])
    assert proc.returncode == 0 and "missing-accumulation-average" in proc.stdout


@pytest.mark.slow
def test_a_bug_on_one_rank_is_named_for_that_rank_and_explains_the_others(tmp_path):
    """rank 1 alone zeroes its gradients inside every window: its cheap check names it; the
    averaged gradient both ranks consume is off, and rank 0 (which saw no zero_grad) takes
    rank 1's finding as the explanation instead of naming a second, vaguer kind."""
    ranks, saved = _torchrun("zero-grad-inside-accumulation", tmp_path)
    record = json.loads(saved[0].read_text())
    assert [f["kind"] for f in record["findings"]] == ["zero-grad-inside-accumulation"]
    finding = record["findings"][0]
    assert finding["evidence"]["rank"] == [1] and finding["evidence"]["measured"] == 1
    assert finding["location"]["line"] == marked_line(LOOP, "zero-grad-inside-accumulation")
    for rank in ranks:
        checked = rank["record"]["watch"]["checked"]
        assert checked and all(not c["ok"] for c in checked)
        assert {c["explained_by"] for c in checked} == {"zero-grad-inside-accumulation"}
