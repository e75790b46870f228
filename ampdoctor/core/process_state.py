"""What a diagnose must leave as it found it, whatever the user's loop did to the process.

`ProcessState.take()` reads the process-wide settings a training loop can change — torch's
grad mode, autocast (entered and never left, its dtype, its cache), anomaly mode, deterministic
algorithms, thread count, default dtype, matmul precision, cuDNN flags, global module hooks, the
RNG states (torch, CUDA, `random`, NumPy) — and the interpreter's (`sys.path`, the recursion
limit, the working directory, signal handlers, warning filters, `sys.stdout`/`sys.stderr`).
`restore()` puts back what changed and names it. Two scopes use it:

- `runner.run_diagnose` around the whole diagnose (`ampdoctor.diagnose()` and an in-process
  CLI run leave the caller's process as it was);
- every run of the user's loop (`LOOP_SCOPE`): a loop that leaves autocast entered or grad mode
  off does not change the next run or the reference (where it would read as a
  nondeterministic baseline).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

#: The autocast device types whose state is kept (those this torch knows).
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
#: The signals whose handlers a run must not leave replaced.
SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in
                            ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR1", "SIGUSR2",
                             "SIGCHLD", "SIGPIPE"))
                if s is not None)
#: The global hooks of every nn.Module (torch.nn.modules.module).
MODULE_HOOKS = ("_global_backward_hooks", "_global_backward_pre_hooks",
                "_global_buffer_registration_hooks", "_global_forward_hooks",
                "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
                "_global_forward_pre_hooks", "_global_module_registration_hooks",
                "_global_parameter_registration_hooks")

#: What one run of the loop is held to (the rest is kept for the whole diagnose only: the RNG
#: is the run's own business, and the default dtype has its own error in the session).
LOOP_SCOPE = frozenset({"grad_mode", "autocast", "anomaly", "deterministic", "threads",
                        "recursion_limit", "cwd", "module_hooks", "matmul_precision", "cudnn"})


def _autocast_nesting(torch: Any) -> int:
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth - 1


def _autocast_state(torch: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"nesting": _autocast_nesting(torch),
                             "cache": torch.is_autocast_cache_enabled()}
    for device in AUTOCAST_DEVICES:
        try:
            state[device] = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        except (RuntimeError, TypeError, AttributeError):
            continue
    return state


def _set_autocast(torch: Any, state: dict[str, Any]) -> None:
    for device in AUTOCAST_DEVICES:
        if device in state:
            enabled, dtype = state[device]
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(state["cache"])
    depth = _autocast_nesting(torch)
    while depth > state["nesting"]:
        depth = torch.autocast_decrement_nesting()
        if depth == 0:
            torch.clear_autocast_cache()


def _take_interpreter(values: dict[str, Any], want: Callable[[str], bool]) -> None:
    """The interpreter's settings a run can change, into `values`."""
    if want("sys_path"):
        values["sys_path"] = list(sys.path)
    if want("recursion_limit"):
        values["recursion_limit"] = sys.getrecursionlimit()
    if want("cwd"):
        with contextlib.suppress(OSError):   # a working directory deleted under the process
            values["cwd"] = os.getcwd()
    if want("signals") and threading.current_thread() is threading.main_thread():
        values["signals"] = {s: signal.getsignal(s) for s in SIGNALS}
    if want("warnings"):
        values["warnings"] = list(warnings.filters)
    if want("streams"):
        values["streams"] = (sys.stdout, sys.stderr, sys.stdin)
    if want("python_rng"):
        import random
        values["python_rng"] = random.getstate()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            values["numpy_rng"] = numpy.random.get_state()


def _take_torch(values: dict[str, Any], want: Callable[[str], bool], torch: Any) -> None:
    """Torch's process-wide settings a run can change, into `values`."""
    if want("grad_mode"):
        values["grad_mode"] = torch.is_grad_enabled()
    if want("autocast"):
        values["autocast"] = _autocast_state(torch)
    if want("anomaly"):
        values["anomaly"] = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    if want("deterministic"):
        values["deterministic"] = (torch.are_deterministic_algorithms_enabled(),
                                   torch.is_deterministic_algorithms_warn_only_enabled())
    if want("threads"):
        values["threads"] = torch.get_num_threads()
    if want("default_dtype"):
        values["default_dtype"] = torch.get_default_dtype()
    if want("matmul_precision"):
        values["matmul_precision"] = torch.get_float32_matmul_precision()
    if want("cudnn"):
        values["cudnn"] = (torch.backends.cudnn.benchmark,
                           torch.backends.cudnn.deterministic, torch.backends.cudnn.enabled)
    if want("module_hooks"):
        from torch.nn.modules import module
        values["module_hooks"] = {name: dict(getattr(module, name)) for name in
                                  MODULE_HOOKS if isinstance(getattr(module, name, None),
                                                             dict)}
    if want("torch_rng"):
        values["torch_rng"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            values["cuda_rng"] = torch.cuda.get_rng_state_all()


@dataclass
class ProcessState:
    values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def take(cls, scope: frozenset[str] | None = None) -> ProcessState:
        """The current state (of `scope`'s items only, when given). Torch's part only once
        torch was imported."""
        values: dict[str, Any] = {}

        def want(name: str) -> bool:
            return scope is None or name in scope

        _take_interpreter(values, want)
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "is_grad_enabled"):
            return cls(values)
        _take_torch(values, want, torch)
        return cls(values)

    def restore(self) -> list[str]:
        """Put back every item that differs now; the names of those that did, for a note."""
        now = ProcessState.take(frozenset(self.values))
        changed = [name for name, value in self.values.items()
                   if name in now.values and not _same(value, now.values[name])]
        for name in changed:
            try:
                _RESTORE[name](self.values[name])
            except Exception:  # noqa: BLE001 - one setting that cannot be put back (a cwd
                continue       # deleted since) must not cost the others or the record
        return changed


def _same(a: Any, b: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list) and a and torch is not None and isinstance(a[0], torch.Tensor):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, tuple) and len(a) == 5 and a and a[0] == "MT19937":   # numpy's RNG
        return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an uncomparable value counts as changed
        return False


def _torch() -> Any:
    import torch
    return torch


def _set_signals(handlers: dict[int, Any]) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def _set_hooks(hooks: dict[str, dict]) -> None:
    from torch.nn.modules import module
    for name, saved in hooks.items():
        current = getattr(module, name)
        current.clear()
        current.update(saved)


def _set_warning_filters(filters: list[Any]) -> None:
    # a list at run time (typeshed declares it a Sequence)
    cast("list[Any]", warnings.filters)[:] = filters


def _set_streams(streams: tuple) -> None:
    sys.stdout, sys.stderr, sys.stdin = streams


def _set_python_rng(state: Any) -> None:
    import random
    random.setstate(state)


def _set_numpy_rng(state: Any) -> None:
    sys.modules["numpy"].random.set_state(state)


def _set_cuda_rng(states: Any) -> None:
    _torch().cuda.set_rng_state_all(states)


def _set_cudnn(flags: tuple) -> None:
    cudnn = _torch().backends.cudnn
    cudnn.benchmark, cudnn.deterministic, cudnn.enabled = flags


_RESTORE: dict[str, Any] = {
    "sys_path": lambda v: sys.path.__setitem__(slice(None), v),
    "recursion_limit": sys.setrecursionlimit,
    "cwd": os.chdir,
    "signals": _set_signals,
    "warnings": _set_warning_filters,
    "streams": _set_streams,
    "python_rng": _set_python_rng,
    "numpy_rng": _set_numpy_rng,
    "grad_mode": lambda v: _torch().set_grad_enabled(v),
    "autocast": lambda v: _set_autocast(_torch(), v),
    "anomaly": lambda v: _torch().set_anomaly_enabled(v[0], v[1]),
    "deterministic": lambda v: _torch().use_deterministic_algorithms(v[0], warn_only=v[1]),
    "threads": lambda v: _torch().set_num_threads(v),
    "default_dtype": lambda v: _torch().set_default_dtype(v),
    "matmul_precision": lambda v: _torch().set_float32_matmul_precision(v),
    "cudnn": _set_cudnn,
    "module_hooks": _set_hooks,
    "torch_rng": lambda v: _torch().set_rng_state(v),
    "cuda_rng": _set_cuda_rng,
}

#: Plain words for the notes a restore leaves.
DESCRIBED = {
    "grad_mode": "grad mode", "autocast": "autocast (entered and not left, or its dtype)",
    "anomaly": "anomaly detection", "deterministic": "torch.use_deterministic_algorithms",
    "threads": "torch's thread count", "recursion_limit": "the recursion limit",
    "cwd": "the working directory", "module_hooks": "global nn.Module hooks",
    "matmul_precision": "torch.set_float32_matmul_precision", "cudnn": "cuDNN flags",
}
