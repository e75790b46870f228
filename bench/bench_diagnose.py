"""Time `ampdoctor diagnose` end to end and measure the comparison noise floor.

    python bench/bench_diagnose.py            # every healthy sample config
    python bench/bench_diagnose.py --rss      # also peak memory via /usr/bin/time -v

Wall time is the whole CLI process (interpreter, torch import, every rung), median of 3 runs,
timed with time.perf_counter. The noise floor is the largest teacher-forced relative error a
healthy recipe shows per precision: the default tolerances must sit well above it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: Path, out: Path, rss: bool) -> tuple[float, dict, int | None]:
    exe = shutil.which("ampdoctor") or sys.executable
    cmd = [exe, "diagnose", str(config), "--json", "--out", str(out)]
    if exe == sys.executable:
        cmd.insert(1, "-m")
        cmd.insert(2, "ampdoctor")
    peak = None
    if rss and Path("/usr/bin/time").exists():
        cmd = ["/usr/bin/time", "-v"] + cmd
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if rss:
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        peak = int(match.group(1)) // 1024 if match else None
    return wall, json.loads(proc.stdout), peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rss", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("configs", nargs="*", type=Path,
                        help="specs to time (default: every healthy sample config)")
    args = parser.parse_args()
    configs = ([p.resolve() for p in args.configs] if args.configs
               else sorted((ROOT / "sample_configs").glob("healthy_*.yaml")))
    floor = {"fp32-accum": 0.0, "bf16-no-scaler": 0.0, "fp16-scaler": 0.0}
    print(f"{'config':32} {'median s':>9} {'peak MiB':>9}  rung seconds")
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            walls, peak, record = [], None, None
            for _ in range(args.repeat):
                wall, record, peak = run(config, Path(tmp), args.rss)
                walls.append(wall)
            for rung in record["rungs"]:
                if rung["id"] in floor:
                    floor[rung["id"]] = max(floor[rung["id"]],
                                            rung["details"].get("max_relative_error", 0.0))
            rungs = " ".join(f"{r['id']}={r['seconds']:.2f}" for r in record["rungs"]
                             if r["status"] != "skip")
            print(f"{config.stem:32} {statistics.median(walls):9.2f} "
                  f"{peak if peak is not None else '-':>9}  {rungs}")
    print("\nnoise floor (max teacher-forced relative error over the healthy recipes):")
    for rung, value in floor.items():
        print(f"  {rung:16} {value:.3g}")


if __name__ == "__main__":
    main()
