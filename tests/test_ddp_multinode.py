"""Two nodes on one host: two `torchrun --nnodes 2` launchers (node ranks 0 and 1) meeting at
127.0.0.1, as a multi-node job launches ampdoctor. DDP and FSDP2 with one process per node; HSDP
with two per node (a 2-D device mesh: shard inside a node, replicate across the nodes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS, RECIPES, CliResult

pytestmark = pytest.mark.slow


def _two_nodes(spec: Path, records_dir: Path, per_node: int) -> tuple[CliResult, CliResult]:
    """Node 0's and node 1's launcher, run side by side to the end."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200", OMP_NUM_THREADS="1")
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
         str(node), "--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "ampdoctor", "diagnose", str(spec), "--json",
         "--out", str(records_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for node in (0, 1)]
    results = []
    try:
        for launcher in launchers:
            out, err = launcher.communicate(timeout=300)
            results.append(CliResult(launcher.returncode, out, err))
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    return results[0], results[1]


def _ddp(record) -> dict:
    return next(r for r in record["rungs"] if r["id"] == "ddp-sync")


def _spec(tmp_path: Path, config: str, **replace: str) -> Path:
    text = (CONFIGS / f"{config}.yaml").read_text().replace("../recipes", str(RECIPES))
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / f"{config}.yaml"
    path.write_text(text)
    return path


def _healthy_across_two_nodes(node0: CliResult, node1: CliResult, records_dir: Path,
                              world_size: int) -> dict:
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    record = node0.record          # node 0's rank 0 alone prints the record and writes it
    assert node1.stdout.strip() == ""
    assert len(list(records_dir.glob("*.json"))) == 1
    assert record["verdict"] == "healthy"
    rung = _ddp(record)
    assert rung["status"] == "pass"
    details = rung["details"]
    assert (details["launch"], details["world_size"]) == ("torchrun", world_size)
    assert details["syncing_backwards"] == [4, 8, 12]
    assert max(details["gradient_difference_between_ranks"]) == 0.0
    return details


def test_ddp_across_two_nodes(tmp_path, records_dir):
    spec = _spec(tmp_path, "healthy_require_grad_sync_ddp")
    details = _healthy_across_two_nodes(*_two_nodes(spec, records_dir, 1), records_dir, 2)
    assert details["wrapper"] == "DDP" and details["shard_wise"] is False


def test_fsdp2_across_two_nodes_is_judged_shard_wise(tmp_path, records_dir):
    spec = _spec(tmp_path, "healthy_fsdp_accumulation_ddp")
    details = _healthy_across_two_nodes(*_two_nodes(spec, records_dir, 1), records_dir, 2)
    assert details["wrapper"] == "FSDP" and details["shard_wise"] is True
    assert details["device_mesh"] == [2]


def test_fsdp2_bug_across_two_nodes(tmp_path, records_dir):
    spec = _spec(tmp_path, "broken_fsdp_sync_one_early")
    node0, node1 = _two_nodes(spec, records_dir, 1)
    assert node0.returncode == 1 and node1.returncode == 1
    finding = node0.record["findings"][0]
    assert (finding["kind"], finding["evidence"]["measured"]) == ("missing-no-sync", 3)
    assert "carried into the next window's reduce-scatter" in finding["message"]


def test_hsdp_shards_inside_a_node_and_replicates_across_nodes(tmp_path, records_dir):
    spec = _spec(tmp_path, "healthy_fsdp_accumulation_ddp",
                 **{"wrapper: fsdp": "wrapper: hsdp", "world_size: 2": "world_size: 4"})
    details = _healthy_across_two_nodes(*_two_nodes(spec, records_dir, 2), records_dir, 4)
    assert details["wrapper"] == "HSDP" and details["shard_wise"] is True
    assert details["device_mesh"] == [2, 2]      # 2 nodes (replicas) x 2 ranks (shards)
    assert details["replica_all_reduces"] == [4, 8, 12]    # across the nodes, once a window
    assert details["parameter_difference_between_ranks"] == 0.0
