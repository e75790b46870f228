"""A diagnose leaves the process as it found it, whatever the loop did (`ampdoctor.diagnose()`
in the caller's process, and the CLI's in-process mode), and a loop that leaves autocast
entered or grad mode off does not change the runs after it."""

from __future__ import annotations

import os
import random
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import ampdoctor
from ampdoctor.core.errors import UsageError

USER = '''
import os
import random
import sys
import threading
import warnings

import numpy as np
import torch

GATE = threading.Event()
ENTERED = threading.Event()


def make():
    return torch.nn.Linear(4, 1)


def data():
    return torch.randn(16, 4), torch.randn(16, 1)


def healthy_steps(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) / K
        scaler.scale(loss).backward()
        if (i + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


def messy_loop(model, optimizer, micro_batches, run):
    healthy_steps(model, optimizer, micro_batches, run)
    # everything below is left behind by the loop, on purpose
    torch.autocast(run.device_type, dtype=run.autocast_dtype or torch.bfloat16,
                   enabled=run.autocast_dtype is not None).__enter__()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.autograd.set_detect_anomaly(True)
    torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    torch.set_float32_matmul_precision("medium")
    sys.path.append("/nonexistent/left/by/the/loop")
    sys.setrecursionlimit(5000)
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    warnings.simplefilter("ignore")


def waiting_loop(model, optimizer, micro_batches, run):
    if os.environ.get("PROC_USER_WAIT") == "1":
        ENTERED.set()
        GATE.wait(60)
    healthy_steps(model, optimizer, micro_batches, run)
'''


def _spec(tmp_path: Path, loop: str) -> Path:
    (tmp_path / "proc_user.py").write_text(USER)
    spec = tmp_path / "spec.yaml"
    spec.write_text("project_root: .\nmodel: proc_user:make\ndata: proc_user:data\n"
                    f"train_loop: proc_user:{loop}\naccumulation_steps: 2\n"
                    "micro_batch_size: 4\noptimizer_steps: 2\ndevice: cpu\n"
                    "precisions: [fp32, bf16, fp16]\n")
    return spec


def _state() -> dict:
    from torch.nn.modules import module
    return {
        "grad": torch.is_grad_enabled(),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "hooks": len(module._global_forward_hooks),
        "matmul": torch.get_float32_matmul_precision(),
        "sys.path": list(sys.path),
        "recursion": sys.getrecursionlimit(),
        "cwd": os.getcwd(),
        "warnings": list(warnings.filters),
        "random": random.random(),
        "numpy": float(np.random.rand()),
        "torch": float(torch.rand(1)),
        "modules": sorted(m for m in sys.modules if m.startswith("proc_user")),
    }


def test_the_process_is_as_it_was_after_a_loop_that_changes_everything(tmp_path):
    spec = _spec(tmp_path, "messy_loop")
    seeds = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    before = _state()
    random.setstate(seeds[0]), np.random.set_state(seeds[1]), torch.set_rng_state(seeds[2])
    record = ampdoctor.diagnose(spec, out=tmp_path / "runs")
    after = _state()
    assert after == before
    # what the loop left behind touched no later run: no misleading verdict
    assert record.verdict == "healthy", record.summary()
    assert not any(f.kind == "nondeterministic-baseline" for f in record.findings)
    assert any("your loop left autocast" in note for note in record.data["notes"])
    assert record.path is not None and record.path.parent == tmp_path / "runs"


def test_a_second_diagnose_in_another_thread_is_refused_at_once(tmp_path):
    from importlib import import_module

    spec = _spec(tmp_path, "waiting_loop")
    results: dict = {}

    def first() -> None:
        results["first"] = ampdoctor.diagnose(spec, save=False)

    os.environ["PROC_USER_WAIT"] = "1"
    thread = threading.Thread(target=first)
    thread.start()
    try:
        # the first diagnose has imported the user module and entered its loop
        for _ in range(600):
            if "proc_user" in sys.modules and sys.modules["proc_user"].ENTERED.is_set():
                break
            thread.join(0.1)
        user = import_module("proc_user")
        assert user.ENTERED.is_set()
        with pytest.raises(UsageError, match="another ampdoctor diagnose is running"):
            ampdoctor.diagnose(spec, save=False)
    finally:
        del os.environ["PROC_USER_WAIT"]
        if "proc_user" in sys.modules:
            sys.modules["proc_user"].GATE.set()
        thread.join(120)
    assert not thread.is_alive()
    assert results["first"].verdict == "healthy", results["first"].summary()
    # and nothing is left patched: a third diagnose runs and agrees
    assert ampdoctor.diagnose(spec, save=False, rungs=["fp32-accum"]).verdict == "healthy"
