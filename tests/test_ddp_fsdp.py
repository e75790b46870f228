"""FSDP2 in the ddp-sync rung: the sync-on-every-micro-batch mode is a warning that states
its trade, a sync never turned back on or turned on one micro-batch early is an error that says
what happened, and a healthy FSDP2 loop stays clean (2 gloo ranks on CPU, spawned)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampdoctor.kinds.base import Observed
from ampdoctor.kinds.sync import sync_on_every_micro_batch
from conftest import CONFIGS, RECIPES, marked_line, run_cli


def _seen() -> Observed:
    return Observed("ddp-sync", "error", "K syncs per window", evidence={"measured": 4.0})


@pytest.mark.parametrize("sharded, update_right, severity", [
    (True, True, "warning"),     # FSDP2's documented mode: the update is right
    (True, False, "error"),      # the update is off too
    (False, True, "error"),      # DDP: K all-reduces save nothing
    (False, False, "error"),
])
def test_one_decider_decides_the_severity_of_a_sync_on_every_micro_batch(
        sharded, update_right, severity):
    finding = sync_on_every_micro_batch(_seen(), sharded=sharded,
                                                 update_right=update_right)
    assert (finding.kind, finding.severity) == ("missing-no-sync", severity)
    assert finding.evidence == {"measured": 4.0}


def _ddp_rung(record):
    return next(r for r in record["rungs"] if r["id"] == "ddp-sync")


def _at_marker(finding, recipe: str, kind: str) -> None:
    marker = RECIPES / recipe
    assert Path(finding["location"]["file"]).resolve() == marker.resolve()
    assert finding["location"]["line"] == marked_line(marker, kind)


@pytest.mark.slow
def test_fsdp_sync_on_every_micro_batch_is_a_warning_with_both_sides_of_the_trade(records_dir):
    name = "broken_fsdp_sync_every_micro_batch"
    result = run_cli("diagnose", CONFIGS / f"{name}.yaml", "--json", "--out", records_dir)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["verdict"] == "healthy"
    rung = _ddp_rung(record)
    assert rung["status"] == "warn"
    assert rung["details"]["wrapper"] == "FSDP"
    assert rung["details"]["syncing_backwards"] == list(range(1, 13))   # K = 4, 3 steps
    (finding,) = record["findings"]
    assert (finding["rung"], finding["kind"], finding["severity"]) == (
        "ddp-sync", "missing-no-sync", "warning")
    evidence = finding["evidence"]
    # the communication, measured: 4 reduce-scatters per window against 1
    assert evidence["reduce_scatters_per_window"] == evidence["measured"] == 4.0
    assert evidence["bytes_per_window"] == 4 * evidence["minimum_bytes_per_window"]
    # the memory it saves, estimated: one reduce-scatter's input, the unsharded gradient
    # (make_mlp: 610 fp32 parameters, padded to 2 ranks)
    assert evidence["unsharded_gradient_bytes_not_held"] == evidence["minimum_bytes_per_window"]
    assert evidence["unsharded_gradient_bytes_not_held"] >= 610 * 4
    assert evidence["max_relative_error"] < 1e-5          # the update is right
    assert "4x the gradient communication" in finding["message"]
    assert f"about {evidence['unsharded_gradient_bytes_not_held']:,} bytes per rank" in (
        finding["message"])
    assert "Keep it if memory is what limits you" in finding["fix"]
    _at_marker(finding, f"{name}.py", "missing-no-sync")


@pytest.mark.slow
def test_fsdp_sync_never_turned_back_on_says_no_rank_stepped(records_dir):
    name = "broken_fsdp_sync_never_on"
    result = run_cli("diagnose", CONFIGS / f"{name}.yaml", "--json", "--out", records_dir)
    assert result.returncode == 1, result.stderr
    record = result.record
    assert record["failed_rung"] == "ddp-sync"
    finding = record["findings"][0]
    assert (finding["kind"], finding["severity"]) == ("gradient-mismatch", "error")
    assert finding["evidence"]["steps_with_a_gradient"] == 0
    assert finding["evidence"]["ratio"] == 0.0
    assert "the sharded .grad stayed None on every rank and no rank stepped at all" in (
        finding["message"])
    assert "set_requires_gradient_sync(i % K == K - 1)" in finding["fix"]
    assert _ddp_rung(record)["details"]["syncing_backwards"] == []
    _at_marker(finding, f"{name}.py", "gradient-mismatch")


@pytest.mark.slow
def test_fsdp_sync_one_micro_batch_early_says_the_last_one_is_carried_over(records_dir):
    result = run_cli("diagnose", CONFIGS / "broken_fsdp_sync_one_early.yaml", "--json",
                     "--out", records_dir)
    assert result.returncode == 1, result.stderr
    finding = result.record["findings"][0]
    assert (finding["kind"], finding["severity"]) == ("missing-no-sync", "error")
    assert "carried into the next window's reduce-scatter" in finding["message"]
    assert "rank-local" not in finding["message"]      # that is DDP's story, not FSDP's


@pytest.mark.slow
def test_healthy_fsdp_no_sync_pattern_stays_clean(records_dir):
    result = run_cli("diagnose", CONFIGS / "healthy_fsdp_accumulation_ddp.yaml", "--json",
                     "--out", records_dir)
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["findings"] == []
    rung = _ddp_rung(record)
    assert rung["status"] == "pass"
    assert rung["details"]["syncing_backwards"] == [4, 8, 12]


@pytest.mark.slow
def test_hsdp_all_reduce_never_turned_back_on_says_no_rank_stepped(records_dir):
    """HSDP on a 2 x 2 mesh (4 spawned ranks, taken as 2 nodes of 2): the reduce-scatters run
    inside each node, the all-reduce across the nodes never does."""
    name = "broken_hsdp_all_reduce_never_on"
    result = run_cli("diagnose", CONFIGS / f"{name}.yaml", "--json", "--out", records_dir)
    assert result.returncode == 1, result.stderr
    record = result.record
    details = _ddp_rung(record)["details"]
    assert (details["wrapper"], details["device_mesh"]) == ("HSDP", [2, 2])
    assert details["replica_all_reduces"] == []
    assert details["syncing_backwards"] == list(range(1, 13))
    finding = record["findings"][0]
    assert (finding["kind"], finding["severity"]) == ("gradient-mismatch", "error")
    assert finding["evidence"]["steps_with_a_gradient"] == 0
    assert finding["evidence"]["windows_not_all_reduced"] == [0, 1, 2]
    assert "never all-reduced across the replicas" in finding["message"]
    assert "no rank stepped at all" in finding["message"]
    _at_marker(finding, f"{name}.py", "gradient-mismatch")
