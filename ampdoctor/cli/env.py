"""`ampdoctor env [--json] [--device D]`: what a bug report needs, and what each AMP rung will
run as on this machine.

Versions of ampdoctor, Python and torch (with its CUDA and cuDNN), and of accelerate,
transformers, Lightning and DeepSpeed when installed: read from the installed distributions'
metadata (`importlib.metadata`), never imported. torch is imported here, when the command runs
(never for `--help`); without torch the command still answers and says so. Each precision is
checked by doing it: a matmul under `torch.autocast` on the device (its output dtype says
whether autocast lowers the precision there) and a `torch.amp.GradScaler` built for it.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from typing import Any

import typer

from .._version import __version__
from ..core.safetext import exc_text, inert

_LABEL = 19

#: Distribution names whose versions a bug report wants (None when not installed).
FRAMEWORKS = ("accelerate", "transformers", "lightning", "pytorch-lightning", "deepspeed")


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution` from its metadata (the package is not
    imported), or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a broken distribution's metadata must not stop `env`
        return None


def _torch() -> tuple[Any, str | None]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return None, exc_text(exc)
    return torch, None


def _cuda(torch: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"available": False, "version": torch.version.cuda,
                            "devices": [], "cudnn": None}
    try:
        info["available"] = bool(torch.cuda.is_available())
        if info["available"]:
            for index in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(index)
                info["devices"].append({"index": index,
                                        "name": torch.cuda.get_device_name(index),
                                        "capability": f"{major}.{minor}"})
        if torch.backends.cudnn.is_available():
            info["cudnn"] = torch.backends.cudnn.version()
    except Exception as exc:  # noqa: BLE001 - a driver problem is what a bug report needs
        info["error"] = exc_text(exc)
    return info


def _device(torch: Any, name: str) -> tuple[Any, str]:
    """The torch device `name` resolves to (as a diagnose resolves the spec's `device`) and a
    line saying why."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), "auto: CUDA is available"
        return torch.device("cpu"), "auto: no CUDA here, every rung runs on the CPU"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter(f"{name!r}: this machine has no CUDA device",
                                 param_hint="--device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise typer.BadParameter(f"{name!r}: this machine has {torch.cuda.device_count()} "
                                 "CUDA device(s)", param_hint="--device")
    return device, f"{name}: as asked"


def _autocast(torch: Any, device: Any, dtype: Any) -> tuple[bool, str]:
    """Does autocast to `dtype` run on `device`, and lower a matmul to it?"""
    try:
        a = torch.ones(4, 4, device=device)
        with torch.autocast(device_type=device.type, dtype=dtype):
            out = a @ a
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return False, exc_text(exc)
    if out.dtype != dtype:
        return False, f"a matmul under autocast stays {out.dtype}"
    return True, f"a matmul under autocast gives {str(dtype).replace('torch.', '')}"


def _scaler(torch: Any, device: Any) -> tuple[bool, str]:
    try:
        scaler = torch.amp.GradScaler(device.type)
    except Exception as exc:  # noqa: BLE001
        return False, exc_text(exc)
    return bool(scaler.is_enabled()), f'torch.amp.GradScaler("{device.type}")'


def _rungs(torch: Any, device: Any) -> list[dict[str, Any]]:
    """What each rung runs as on `device` (CONTRACT §3)."""
    where = "on the CPU" if device.type == "cpu" else f"on {device}"
    if device.type == "cuda":
        try:
            if not torch.cuda.is_bf16_supported():
                bf16 = (False, f"{torch.cuda.get_device_name(device)} has no bf16 support: "
                               "the rung is skipped")
            else:
                bf16 = _autocast(torch, device, torch.bfloat16)
        except Exception as exc:  # noqa: BLE001
            bf16 = (False, exc_text(exc))
    else:
        bf16 = _autocast(torch, device, torch.bfloat16)
    fp16 = _autocast(torch, device, torch.float16)
    scaler_ok, scaler = _scaler(torch, device)
    fp16_runs = fp16[0] and scaler_ok
    fp16_line = (f"fp16 autocast {where} with {scaler}" if fp16_runs
                 else f"fp16 cannot run {where}: {fp16[1] if not fp16[0] else scaler}")
    dist = getattr(torch, "distributed", None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    has_backend = bool(dist is not None and dist.is_available() and (
        dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()))
    return [
        {"id": "reproducibility", "runs": True, "as": f"fp32 {where}, twice", "check": ""},
        {"id": "fp32-accum", "runs": True, "as": f"fp32 {where}", "check": ""},
        {"id": "bf16-no-scaler", "runs": bf16[0],
         "as": f"bf16 autocast {where}, no GradScaler" if bf16[0]
         else f"skipped: {bf16[1]}", "check": bf16[1] if bf16[0] else ""},
        {"id": "fp16-scaler", "runs": fp16_runs, "as": fp16_line,
         "check": fp16[1] if fp16_runs else ""},
        {"id": "double-scaling", "runs": True,
         "as": "a static scan of the code and configs (plus the fp16 run's GradScaler)",
         "check": ""},
        {"id": "clip-space", "runs": fp16_runs, "as": f"the fp16 run: {fp16_line}", "check": ""},
        {"id": "skips", "runs": fp16_runs,
         "as": f"the fp16 run with an injected overflow: {fp16_line}", "check": ""},
        {"id": "ddp-sync", "runs": has_backend,
         "as": (f"only with `ddp` in the spec: torch.distributed over {backend} {where}"
                if has_backend else f"skipped: torch.distributed has no {backend} here"),
         "check": ""},
    ]


def collect(device: str = "auto") -> dict[str, Any]:
    """Everything `env` shows, as data (the `--json` shape)."""
    data: dict[str, Any] = {
        "ampdoctor": __version__,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(terse=True),
        "torch": None,
        "cuda": None,
        "frameworks": {name: installed_version(name) for name in FRAMEWORKS},
        "device": None,
        "device_reason": None,
        "rungs": [],
    }
    torch, problem = _torch()
    if torch is None:
        data["torch_error"] = problem
        data["device_reason"] = "torch cannot be imported: no rung can run"
        return data
    data["torch"] = torch.__version__
    data["cuda"] = _cuda(torch)
    resolved, reason = _device(torch, device)
    data["device"] = str(resolved)
    data["device_reason"] = reason
    data["rungs"] = _rungs(torch, resolved)
    return data


def _text(data: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        return "not installed" if value is None else inert(value, multiline=False)

    def row(label: str, value: str) -> str:
        return f"{label:<{_LABEL}}{value}"

    lines = [row("ampdoctor", show(data["ampdoctor"])),
             row("python", f"{show(data['python'])} ({show(data['python_implementation'])}, "
                           f"{show(data['executable'])})"),
             row("platform", show(data["platform"]))]
    if data["torch"] is None:
        lines.append(row("torch", f"cannot be imported: {show(data.get('torch_error'))}"))
    else:
        cuda = data["cuda"] or {}
        lines.append(row("torch", show(data["torch"])))
        built = cuda.get("version")
        lines.append(row("CUDA",
            f"available, {len(cuda['devices'])} device(s); torch built for CUDA {built}"
            if cuda.get("available") else
            f"not available (torch built for CUDA {built})" if built else
            "not available (a CPU-only torch)"))
        for dev in cuda.get("devices", []):
            lines.append(row(f"  cuda:{dev['index']}", f"{show(dev['name'])} "
                                                       f"(compute capability {dev['capability']})"))
        lines.append(row("cuDNN", show(cuda.get("cudnn")) if cuda.get("cudnn") else "none"))
        if cuda.get("error"):
            lines.append(f"  (CUDA query failed: {show(cuda['error'])})")
    for name, version in data["frameworks"].items():
        lines.append(row(name, show(version)))
    lines.append("")
    lines.append(row("device", f"{show(data['device'])} ({show(data['device_reason'])})"))
    if data["rungs"]:
        lines.append("rungs on this machine:")
        width = max(len(r["id"]) for r in data["rungs"])
        for rung in data["rungs"]:
            check = f"  [{show(rung['check'])}]" if rung["check"] else ""
            lines.append(f"  {rung['id']:<{width}}  {show(rung['as'])}{check}")
    return "\n".join(lines)


def env(
    json_out: bool = typer.Option(False, "--json", help="Print the same as JSON on stdout."),
    device: str = typer.Option("auto", "--device", help="The device to describe, as in a "
                               "spec: auto, cpu, cuda or cuda:N."),
) -> None:
    """Versions (ampdoctor, Python, torch, CUDA/cuDNN, frameworks), the device, and what each AMP
    rung runs as on this machine: what a bug report needs."""
    from ..spec import DEVICE_RE

    if not DEVICE_RE.match(device):
        raise typer.BadParameter(f"{device!r} is not a device: use auto, cpu, cuda or cuda:N",
                                 param_hint="--device")
    data = collect(device)
    if json_out:
        sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=True) + "\n")
    else:
        typer.echo(_text(data))
