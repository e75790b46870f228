"""ampdoctor diagnose against the hand-written triage of the same questions, side by side.

    python bench/bench_triage.py small                  # sample_configs/healthy_adamw_clip_sched
    python bench/bench_triage.py wide                   # bench/wide/wide22m_k4.yaml (22M params)
    python bench/bench_triage.py wide --steps 12        # memory flat in optimizer_steps?
    python bench/bench_triage.py wide16                 # K = 16
    python bench/bench_triage.py wide2                  # K = 2
    python bench/bench_triage.py gpt2                   # GPT-2-small-sized (124M), CUDA if present
    python bench/bench_triage.py gpt2-mini              # the same transformer, 4 layers x 256
    python bench/bench_triage.py SPEC.yaml --repeats 5 --also /path/to/other/checkout

Each repeat runs `ampdoctor diagnose SPEC --json` (with AMPDOCTOR_COUNT_PASSES=1, so every rung
reports its forward passes), `bench/handwritten_triage.py SPEC` (no probe, no CLI: the fp32
reference twice, the loop in fp32, bf16, fp16 and fp16 again) and `handwritten_triage.py SPEC
--bare` (the loop alone, once per precision: the memory target's denominator) as whole
processes, alternated, each under /usr/bin/time -v for its peak RSS. Prints medians, the ratio,
peak CUDA memory (on a GPU) and the passes per rung. `--also TREE` alternates a third process:
ampdoctor from another checkout (PYTHONPATH=TREE), for a before/after in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NAMED = {
    "small": ROOT / "sample_configs" / "healthy_adamw_clip_sched.yaml",
    "wide": HERE / "wide" / "wide22m_k4.yaml",
    "wide16": HERE / "wide" / "wide22m_k16.yaml",
    "wide2": HERE / "wide" / "wide22m_k2.yaml",
    "gpt2": HERE / "gpt2" / "gpt2_small.yaml",
    "gpt2-mini": HERE / "gpt2" / "gpt2_mini.yaml",
}


def prepared_spec(path: Path, tmp: Path, steps: int | None, K: int | None,
                  device: str | None) -> Path:
    """The spec with an absolute project_root and the overrides applied."""
    spec = yaml.safe_load(path.read_text())
    spec["project_root"] = str((path.parent / spec.get("project_root", ".")).resolve())
    if steps:
        spec["optimizer_steps"] = steps
    if K:
        total = spec["accumulation_steps"] * spec.get("micro_batch_size", 1)
        spec["accumulation_steps"] = K
        if spec.get("micro_batch_size"):
            spec["micro_batch_size"] = max(1, total // K)   # same samples per optimizer step
    if device:
        spec["device"] = device
    spec.pop("scan", None)
    out = tmp / f"{path.stem}.yaml"
    out.write_text(yaml.safe_dump(spec))
    return out


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, int | None, str]:
    if Path("/usr/bin/time").exists():
        cmd = ["/usr/bin/time", "-v"] + cmd
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - started
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if proc.returncode not in (0, 1):   # 1: diagnose found something
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"{cmd} exited {proc.returncode}")
    return wall, int(match.group(1)) * 1024 if match else None, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", help="a spec path or one of " + ", ".join(NAMED))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, help="override optimizer_steps")
    parser.add_argument("--K", type=int, help="override accumulation_steps (same samples/step)")
    parser.add_argument("--device", help="override device (cuda is used when present for gpt2)")
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="another ampdoctor checkout to alternate (before/after)")
    args = parser.parse_args()
    path = NAMED.get(args.config, Path(args.config)).resolve()
    device = args.device
    if device is None and args.config.startswith("gpt2"):
        try:
            import torch
            device = "cuda" if torch.cuda.is_available() else None
        except ImportError:
            pass
    variants = {"ampdoctor": ROOT, **{f"ampdoctor@{p}": p.resolve() for p in args.also}}
    with tempfile.TemporaryDirectory() as tmp:
        spec = prepared_spec(path, Path(tmp), args.steps, args.K, device)
        runs: dict[str, list[tuple[float, int | None]]] = {name: [] for name in variants}
        runs["hand-written"] = []
        runs["bare loop"] = []
        bare_cuda = None
        passes: dict[str, dict] = {}
        inner: list[float] = []
        cuda_peak = None
        cuda_peaks: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, tree in variants.items():
                env = dict(os.environ, AMPDOCTOR_COUNT_PASSES="1",
                           PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                cmd = [sys.executable, "-m", "ampdoctor", "diagnose", str(spec), "--json",
                       "--out", str(Path(tmp) / "runs")]
                wall, rss, out = timed(cmd, env, Path(tmp))
                runs[name].append((wall, rss))
                record = json.loads(out)
                passes[name] = {r["id"]: (r.get("details") or {}).get("passes")
                                for r in record["rungs"]}
                passes[name]["verdict"] = record["verdict"]
                peaks = [(r.get("details") or {}).get("cuda_peak_bytes") or 0
                         for r in record["rungs"]]
                if any(peaks):
                    cuda_peaks[name] = max(peaks)
            wall, rss, out = timed([sys.executable, str(HERE / "handwritten_triage.py"),
                                    str(spec)], dict(os.environ), Path(tmp))
            runs["hand-written"].append((wall, rss))
            result = json.loads(out)
            inner.append(result["wall_s"])
            passes["hand-written"] = result["forwards"]
            cuda_peak = result.get("peak_cuda_bytes")
            wall, rss, out = timed([sys.executable, str(HERE / "handwritten_triage.py"),
                                    str(spec), "--bare"], dict(os.environ), Path(tmp))
            runs["bare loop"].append((wall, rss))
            bare_cuda = json.loads(out).get("peak_cuda_bytes")
    base = statistics.median(w for w, _ in runs["hand-written"])
    print(f"spec {path.name}  (steps={args.steps or 'spec'}, K={args.K or 'spec'}, "
          f"device={device or 'spec'}), {args.repeats} alternated runs, medians")
    print(f"{'':28} {'wall s':>8} {'ratio':>6} {'pairwise':>8} {'peak RSS MB':>12} "
          f"{'RSS ratio':>9} {'RSS / bare loop':>15}")

    def median_rss(values):
        return statistics.median(r for _, r in values) if all(r for _, r in values) else None

    base_rss, bare_rss = median_rss(runs["hand-written"]), median_rss(runs["bare loop"])
    spreads: dict[str, tuple[float, float]] = {}
    for name, values in runs.items():
        wall = statistics.median(w for w, _ in values)
        rss = median_rss(values)
        pairs = [w / h for (w, _), (h, _) in zip(values, runs["hand-written"], strict=True)]
        pairwise = statistics.median(pairs)
        spreads[name] = (min(pairs), max(pairs))
        print(f"{name:28} {wall:8.2f} {wall / base:6.2f} {pairwise:8.2f} "
              f"{(rss or 0) / 2**20:12.0f} {(rss / base_rss if rss and base_rss else 0):9.2f} "
              f"{(rss / bare_rss if rss and bare_rss else 0):15.2f}")
    print("(ratio: median wall time over the hand-written triage's; pairwise: the median of each "
          "repeat's ratio, the runs of one repeat being back to back; RSS / bare loop: peak RSS "
          "over the loop's own, run once per precision)")
    print("pairwise wall ratio, lowest-highest over the repeats: " + "; ".join(
        f"{name} {low:.2f}-{high:.2f}" for name, (low, high) in spreads.items()))
    print("peak RSS MB per repeat: " + "; ".join(
        f"{name} " + ", ".join(f"{(r or 0) / 2**20:.0f}" for _, r in values)
        for name, values in runs.items()))
    if cuda_peak:
        print(f"hand-written peak CUDA memory: {cuda_peak / 2**20:.0f} MB")
    if bare_cuda:
        print(f"bare loop peak CUDA memory: {bare_cuda / 2**20:.0f} MB")
    for name, peak in cuda_peaks.items():
        print(f"{name} peak CUDA memory: {peak / 2**20:.0f} MB")
    print("forward passes per rung:")
    for name, per in passes.items():
        print(f"  {name}: {json.dumps(per)}")


if __name__ == "__main__":
    main()
