"""Script mode's cost against the script's own: is start-up paid once per command line?

    python bench/bench_script_cost.py                 # the heavy script and the light one
    python bench/bench_script_cost.py heavy --repeats 2
    python bench/bench_script_cost.py light

For each script it measures, as whole processes, `time.perf_counter`:

- one plain start-up: `python SCRIPT ARGS` from the interpreter's start to the end of its first
  optimizer step (a global optimizer step post-hook records the time of each step; the script
  runs unmodified as `__main__`, see `--plain`);
- the plain per-step time: the median time between its later optimizer steps (steps 2..8),
  of the command line as given (fp16 with `--amp`) and, the stricter budget, without `--amp`
  (fp32: on a CPU fp16 steps are slower, and most of a diagnose's runs are fp32);
- `ampdoctor diagnose SCRIPT --json --reference-args REF -- ARGS` under /usr/bin/time -v
  (wall, peak RSS), and from its record the optimizer steps all its runs and references took
  together (each run's `optimizer_steps` in the record's `output`);

and prints diagnose wall / (start-up + per-step x steps) against the 1.25x target, with the
command that reproduces each number. `heavy` is `bench/scripts/train_vit.py` (transformers' ViT,
a folder of PNGs read by a Dataset, DataLoader with 2 persistent workers, fp16 autocast, a
GradScaler, K = 4); `light` is `recipes/scripts/amp_recipe.py` (an MLP on tensors, K = 4).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
IMAGES = os.path.join(tempfile.gettempdir(), "ampdoctor_bench_vit_images")
SCRIPTS = {
    "heavy": (HERE / "scripts" / "train_vit.py",
              ["--data", IMAGES, "--amp", "--accum-steps", "4", "--batch-size", "8"],
              ["--data", IMAGES, "--amp", "--accum-steps", "1", "--batch-size", "32"]),
    "light": (ROOT / "recipes" / "scripts" / "amp_recipe.py",
              ["--amp", "--accum-steps", "4", "--batch-size", "8"],
              ["--amp", "--accum-steps", "1", "--batch-size", "32"]),
}
PLAIN_STEPS = 8


def plain_main(argv: list[str]) -> None:
    """`--plain N SCRIPT ARGS...`: run SCRIPT as `__main__` and print, as JSON on the last line
    of stdout, the perf_counter time of each of its first N optimizer steps, then leave."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps, script, args = int(argv[0]), argv[1], argv[2:]
    times: list[float] = []

    def hook(optimizer, a, k):
        times.append(time.perf_counter())
        if len(times) >= steps:
            sys.stdout.flush()
            print("\n" + json.dumps({"steps": times}), flush=True)
            os._exit(0)

    register_optimizer_step_post_hook(hook)
    del torch
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    print("\n" + json.dumps({"steps": times}), flush=True)
    os._exit(0)


def plain(script: Path, args: list[str]) -> tuple[float, float, str]:
    """(start-up to the first step, median later step, the command)."""
    command = [sys.executable, str(Path(__file__)), "--plain", str(PLAIN_STEPS), str(script),
               *args]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"]
    startup = steps[0] - start
    per_step = statistics.median(b - a for a, b in zip(steps, steps[1:], strict=False))
    return startup, per_step, " ".join(command[1:])


def diagnose(script: Path, args: list[str], ref: list[str], out: str) -> dict:
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "ampdoctor", "diagnose", str(script),
               "--json", "--out", out, "--reference-args", " ".join(ref), "--", *args]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.exit(f"diagnose exited {done.returncode}:\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    runs = record.get("output") or []
    steps = [r.get("optimizer_steps") for r in runs]
    return {"wall": wall, "rss_mb": int(rss.group(1)) / 1024 if rss else float("nan"),
            "verdict": record.get("verdict"), "runs": len(runs),
            "steps": sum(s or 0 for s in steps), "per_run": [(r["run"], s) for r, s in
                                                              zip(runs, steps, strict=False)],
            "command": "ampdoctor " + " ".join(repr(c) if " " in c else c
                                               for c in command[5:] if c not in ("--out", out))}


def bench(name: str, repeats: int) -> dict:
    script, args, ref = SCRIPTS[name]
    if name == "heavy" and not os.path.isdir(IMAGES):   # the images, written once
        plain(script, args)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(repeats):
            startup, per_step, plain_cmd = plain(script, args)
            _, per_step32, _ = plain(script, [a for a in args if a != "--amp"])
            diag = diagnose(script, args, ref, out)
            budget = startup + per_step * diag["steps"]
            budget32 = startup + per_step32 * diag["steps"]
            rows.append({"startup": startup, "per_step": per_step, "budget": budget,
                         "ratio": diag["wall"] / budget, "plain_command": plain_cmd,
                         "per_step32": per_step32, "budget32": budget32,
                         "ratio32": diag["wall"] / budget32, **diag})
    return {"name": name, "rows": rows}


def report(result: dict) -> None:
    rows = result["rows"]
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("startup", "per_step", "wall", "ratio", "rss_mb", "steps", "budget",
                     "per_step32", "budget32", "ratio32")}
    last = rows[-1]
    print(f"\n== {result['name']}: {len(rows)} repeat(s), medians")
    print(f"plain start-up to the first step: {med['startup']:.2f} s   "
          f"(python {last['plain_command']})")
    print(f"plain per-step time:              {med['per_step']:.3f} s   (same run, steps 2..)")
    print(f"  the same without --amp (fp32):  {med['per_step32']:.3f} s   (most of a diagnose's "
          "runs and every reference are fp32)")
    print(f"optimizer steps of the diagnose:  {med['steps']:.0f} in {last['runs']} runs  "
          + ", ".join(f"{run} {s}" for run, s in last["per_run"]))
    print(f"diagnose wall:                    {med['wall']:.2f} s, peak RSS "
          f"{med['rss_mb']:.0f} MB, verdict {last['verdict']}   ({last['command']})")
    print(f"budget = start-up + per-step x steps = {med['budget']:.2f} s")
    held = "holds" if med["ratio"] <= 1.25 else "does NOT hold"
    print(f"ratio diagnose / budget: {med['ratio']:.2f}x (each repeat: "
          + ", ".join(f"{r['ratio']:.2f}" for r in rows) + f"); target <= 1.25x {held}")
    held32 = "holds" if med["ratio32"] <= 1.25 else "does NOT hold"
    print(f"against the fp32 per-step time:  budget {med['budget32']:.2f} s, ratio "
          f"{med['ratio32']:.2f}x; target <= 1.25x {held32}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--plain":
        plain_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="*", help="heavy, light (default: both)")
    parser.add_argument("--repeats", type=int, default=1)
    options = parser.parse_args()
    unknown = set(options.which) - set(SCRIPTS)
    if unknown:
        parser.error(f"unknown script(s) {sorted(unknown)}: choose from {sorted(SCRIPTS)}")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    # ampdoctor's bytecode written first, as a pip install writes it (an editable install under
    # PYTHONDONTWRITEBYTECODE=1 would compile every module again in every process it starts)
    import compileall

    import ampdoctor
    compileall.compile_dir(os.path.dirname(ampdoctor.__file__), quiet=1)
    for name in options.which or list(SCRIPTS):
        report(bench(name, options.repeats))
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
