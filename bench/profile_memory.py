"""Where each megabyte of a diagnose goes: ampdoctor's run on a spec, phase by phase.

    python bench/profile_memory.py wide                 # bench/wide/wide22m_k4.yaml, 3 steps
    python bench/profile_memory.py wide --steps 12
    python bench/profile_memory.py wide2 | wide16        # K = 2, K = 16
    python bench/profile_memory.py SPEC.yaml [--json OUT]

Runs `ampdoctor.diagnose` in this process (the CLI runs the same code in its worker process)
and, at every phase boundary, reads the process's resident memory from /proc/self/status:
VmRSS (now) and VmHWM (the peak since the last boundary: the peak is reset at each boundary by
writing 5 to /proc/self/clear_refs). The boundaries: interpreter start, `import torch`,
ampdoctor's imports, the session (template model and micro-batches), each rung's start and end,
each run of the loop (model, optimizer and probe built; loop returned; training state dropped),
and in the runs judged as they go, each step group's reference (computed inside the optimizer's
step pre-hook, the moment the most is alive) and each judged step.

At each boundary the Python-visible tensors are counted by owner (each storage once, in the
first owner that holds it): the template's weights (= the initial state), the reference model's
weights and gradients, the reference gradient the judge holds for the group, the live run's
weights, gradients and optimizer state, the gradient copies and weight snapshots the traces
keep, the micro-batches, and any other tensor reachable from Python. What RSS holds beyond them
is the interpreter, torch's libraries, autograd's saved activations (no Python object) and
the allocator's free-but-kept pages.

Prints one line per boundary (MB = 2**20 bytes) and a summary of the phases' peaks; `--json`
writes every sample. Linux only (/proc).
"""

from __future__ import annotations

import re
import sys
import time

_STATUS = re.compile(r"(VmRSS|VmHWM):\s+(\d+) kB")


def vm() -> dict[str, float]:
    with open("/proc/self/status") as f:
        return {k: int(v) / 1024 for k, v in _STATUS.findall(f.read())}


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


SAMPLES: list[dict] = [{"phase": "interpreter", **vm(), "t": 0.0}]
_T0 = time.perf_counter()
reset_peak()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import weakref  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

SAMPLES.append({"phase": "import torch", **vm(), "t": time.perf_counter() - _T0})
reset_peak()

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_triage import NAMED, prepared_spec  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor import session as session_mod  # noqa: E402
from ampdoctor.judge import live as judge_live  # noqa: E402
from ampdoctor.reference import gradients as ref_mod  # noqa: E402

SAMPLES.append({"phase": "import ampdoctor", **vm(), "t": time.perf_counter() - _T0})
reset_peak()

MB = 2**20
STATE: dict = {"session": None, "traces": [], "judge": None, "rung": "-", "count": True}


def _storages(tensors) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if s.nbytes():
                out[s.data_ptr()] = s.nbytes()
    return out


def _grads_dict(d) -> list:
    if isinstance(d, dict) or type(d).__name__ == "_Kept":
        try:
            return [v for v in d.values() if isinstance(v, torch.Tensor)]
        except Exception:  # noqa: BLE001 - any container the probe keeps
            return []
    return []


def owners() -> dict[str, float]:
    """MB of Python-visible tensor storage per owner (each storage counted once, first owner)."""
    session = STATE["session"]
    groups: list[tuple[str, list]] = []
    if session is not None:
        groups.append(("template = initial state", list(session.initial_state.values())))
        ref = session._ref_model
        if ref is not None:
            groups.append(("reference model weights", list(ref.state_dict().values())))
            groups.append(("reference model .grad", [p.grad for p in ref.parameters()]))
        cached = session._ref_cache
        judge = STATE["judge"]() if STATE["judge"] is not None else None
        held = []
        if judge is not None and judge._reference is not None:
            held += list(judge._reference[1].values())
        if cached is not None:   # (a large one is on disk: `full` is then empty)
            held += list(getattr(cached[1], "ref", cached[1]).full.values())
        groups.append(("reference gradient held (judge / cache)", held))
    live_w, live_g, opt_state, kept, snaps = [], [], [], [], []
    for ref_trace in STATE["traces"]:
        trace = ref_trace()
        if trace is None:
            continue
        model = trace.model
        if model is not None:
            live_w += list(model.state_dict().values())
            live_g += [p.grad for p in model.parameters()]
        for opt in trace.optimizers:
            for st in opt.state.values():
                opt_state += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for step in trace.steps:
            kept += _grads_dict(step.grads)
        for snap in trace.snapshots.values():
            kept_state = getattr(snap, "state", None) or getattr(snap, "params", None)
            snaps += _grads_dict(kept_state) if kept_state is not None else []
    groups += [("run models' weights", live_w), ("run models' .grad", live_g),
               ("optimizer state", opt_state), ("kept gradient copies (steps)", kept),
               ("kept weight snapshots", snaps)]
    if session is not None:
        mbs = [t for mb in session.micro_batches
               for t in (mb.values() if isinstance(mb, dict) else mb)]
        groups.append(("micro-batches", mbs))
    seen: set[int] = set()
    out: dict[str, float] = {}
    for name, tensors in groups:
        sizes = {p: n for p, n in _storages(tensors).items() if p not in seen}
        seen |= set(sizes)
        out[name] = out.get(name, 0.0) + sum(sizes.values()) / MB
    others = _storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    out["other Python-visible tensors"] = sum(n for p, n in others.items()
                                              if p not in seen) / MB
    return out


def mark(phase: str, count: bool = True) -> None:
    sample = {"phase": phase, "rung": STATE["rung"], **vm(), "t": time.perf_counter() - _T0}
    if count and STATE["count"]:
        sample["owners"] = owners()
    SAMPLES.append(sample)
    reset_peak()


def wrap(cls, name: str, before=None, after=None) -> None:
    original = getattr(cls, name)

    def wrapped(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after:
            after(result, *args, **kwargs)
        return result

    setattr(cls, name, wrapped)


def install() -> None:
    S = session_mod.Session

    def session_made(_r, self, *a, **k):
        STATE["session"] = self
        mark("session built (template model, micro-batches)")

    wrap(S, "__init__", after=session_made)

    def prepared(run, self, precision, *a, **k):
        STATE["traces"].append(weakref.ref(run.trace))
        mark(f"run {precision}: model, optimizer, probe built")
        return run

    wrap(S, "_prepare", after=prepared)
    wrap(S, "_execute", after=lambda r, self, run: mark(
        f"run {run.trace.precision}: loop returned (state alive)"))
    wrap(S, "run_loop", after=lambda trace, self, precision, **k: mark(
        f"run {precision}: training state dropped, trimmed"))
    wrap(S, "rung_done", after=lambda r, self, rung: mark(f"rung {rung} done, trimmed"))
    wrap(ref_mod.ReferenceBuilder, "_model_at", before=lambda self, *a, **k: (
        mark("before reference model built", count=False)
        if self._ref_model is None else None))

    def began(result, judge, group, *a, **k):
        STATE["judge"] = weakref.ref(judge)
        mark(f"run {judge.precision}: group {group} reference computed (in step pre-hook)")

    wrap(judge_live.StepJudge, "begin_group", after=began)
    wrap(judge_live.StepJudge, "on_step", after=lambda keep, judge, step: mark(
        f"run {judge.precision}: step {step.seq} judged"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", help="a spec path or one of " + ", ".join(NAMED))
    parser.add_argument("--steps", type=int)
    parser.add_argument("--K", type=int)
    parser.add_argument("--no-owners", action="store_true",
                        help="RSS only (no tensor census: no gc walk at each boundary)")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args()
    STATE["count"] = not args.no_owners
    path = NAMED.get(args.config, Path(args.config)).resolve()
    install()
    with tempfile.TemporaryDirectory() as tmp:
        spec = prepared_spec(path, Path(tmp), args.steps, args.K, None)
        os.chdir(tmp)

        def started(rung: str) -> None:
            STATE["rung"] = rung
            mark(f"rung {rung} starts", count=False)

        record = ampdoctor.diagnose(str(spec), save=False, on_start=started)
    STATE["session"] = None
    mark("diagnose returned (record built)")
    print(f"spec {path.name} (steps={args.steps or 'spec'}, K={args.K or 'spec'}): "
          f"verdict {record.verdict}, {time.perf_counter() - _T0:.1f} s")
    print(f"{'t s':>6} {'RSS':>6} {'peak':>6}  phase (the peak is since the line before)")
    for s in SAMPLES:
        print(f"{s['t']:6.1f} {s['VmRSS']:6.0f} {s.get('VmHWM', 0):6.0f}  {s['phase']}")
        if s.get("owners"):
            parts = [f"{k} {v:.0f}" for k, v in s["owners"].items() if v >= 0.5]
            print(f"{'':21}tensors MB: " + "; ".join(parts))
    peak = max(SAMPLES, key=lambda s: s.get("VmHWM", 0))
    print(f"\npeak RSS {peak['VmHWM']:.0f} MB, in the phase ending at: {peak['phase']} "
          f"(rung {peak.get('rung', '-')})")
    if args.json:
        args.json.write_text(json.dumps(SAMPLES, indent=1))


if __name__ == "__main__":
    main()
