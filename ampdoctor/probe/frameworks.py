"""What a training framework decided to run when it was asked for a precision.

accelerate (and so the HF Trainer) trains in fp32 when asked for fp16 on a CPU (no autocast,
no GradScaler, no warning); Lightning and Fabric switch `16-mixed` to `bf16-mixed` there. A
rung that asked for fp16 must say what really ran and where it was asked for, so the probe
records a `FrameworkPrecision` event when the loop builds an `Accelerator`, a Lightning
`Trainer` or a `Fabric`. Only frameworks the process already imported are patched; nothing is
imported here.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import deepspeed, recorder
from .events import FrameworkPrecision
from .patches import Patcher


def _mixed(value: Any) -> str | None:
    """fp32 / bf16 / fp16 for a Lightning precision flag; None for a mode without a rung."""
    text = "32-true" if value is None else str(value)
    if text in ("32", "32-true"):
        return "fp32"
    if text in ("bf16", "bf16-mixed"):
        return "bf16"
    if text in ("16", "16-mixed"):
        return "fp16"
    return None


def _asking_site(frame: Any) -> Any:
    """Where the precision was asked: the `TrainingArguments(...)` line when an HF Trainer
    builds the Accelerator (the arguments carry the site they were built at), else None."""
    while frame is not None:
        owner = frame.f_locals.get("self")
        site = getattr(getattr(owner, "args", None), "_ampdoctor_site", None)
        if site is not None and any(c.__module__.startswith("transformers")
                                    for c in type(owner).__mro__):
            return site
        frame = frame.f_back
    return None


def _record(framework: str, asked: str, ran: str | None, reason: str) -> None:
    probe = recorder.ACTIVE
    if probe is None:
        return
    caller = sys._getframe(2)
    trainer_site = _asking_site(caller)
    site = trainer_site or probe.finder.from_frame(caller)
    probe.record(FrameworkPrecision, site=site, framework=framework, asked=asked, ran=ran,
                 reason=reason, driver="HF Trainer" if trainer_site is not None else "")


def _wrap_accelerator_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        state = getattr(self, "state", None)
        if "DEEPSPEED" in str(getattr(state, "distributed_type", "")):
            return   # accelerate hands the precision to DeepSpeed: the engine says what it ran
        asked = str(getattr(state, "mixed_precision", "no"))
        device = getattr(getattr(self, "device", None), "type", "?")
        native = bool(getattr(self, "native_amp", False))
        ran: str | None
        reason = ""
        if asked == "no":
            ran = "fp32"
        elif asked in ("fp16", "bf16") and native:
            ran = asked
        elif asked in ("fp16", "bf16"):
            ran = "fp32"
            reason = (f"accelerate runs {asked} mixed precision only where its autocast and "
                      f"loss scaler run; on {device} it trains in fp32 (no autocast, no "
                      "GradScaler) without a warning")
        else:
            ran = None
        _record("accelerate", asked, ran, reason)
    return __init__


def _wrap_lightning_init(original: Callable[..., Any], framework: str,
                         final: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        asked = kwargs.get("precision")
        chosen = getattr(self, final, asked)
        reason = ""
        if _mixed(asked) != _mixed(chosen):
            device = type(getattr(self, "accelerator", None)).__name__.replace("Accelerator", "")
            reason = (f"{framework} replaced precision={asked!r} by {chosen!r}"
                      + (f" on {device.lower() or 'this device'}" if device else "")
                      + " (AMP with fp16 is not supported there)")
        _record(framework, str(asked if asked is not None else "32-true"), _mixed(chosen),
                reason)
    return __init__


def _wrap_training_args_post_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if recorder.ACTIVE is not None and getattr(self, "deepspeed", None) and \
                not torch.distributed.is_initialized():
            # the arguments start accelerate's process group for the DeepSpeed engine here
            deepspeed.group_of_one()
        original(self, *args, **kwargs)
        probe = recorder.ACTIVE
        if probe is not None:
            # the dataclass __init__ calls __post_init__: the user's line is above both
            object.__setattr__(self, "_ampdoctor_site", probe.finder.from_frame(sys._getframe(1)))
    return __post_init__


class _LossSites(TorchFunctionMode):
    """Inside a framework's training step: remember the user's line that produced the last
    scalar that requires grad (the loss), so the backward the framework calls later is put
    at that line. Only scalars made by a call *from the user's code* count: the framework's
    own `loss / K` keeps the user's line."""

    def __init__(self, probe: Any) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.dim() == 0 and result.requires_grad:
            site = self.probe.finder.direct_user_site(sys._getframe(1))
            if site is not None:
                self.probe.loss_site = site
        return result


def _wrap_training_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = recorder.ACTIVE
        if probe is None:
            return original(self, *args, **kwargs)
        probe.loss_site = None    # a step's loss, not an earlier one's
        with _LossSites(probe):
            return original(self, *args, **kwargs)
    return training_step


#: The framework methods that compute the loss of one micro-batch and may call backward
#: themselves: (module, class).
_TRAINING_STEPS = (
    ("transformers.trainer", "Trainer"),
    ("lightning.pytorch.strategies.strategy", "Strategy"),
    ("pytorch_lightning.strategies.strategy", "Strategy"),
)


#: (module, class, attribute read after __init__, framework name) for Lightning's connectors.
_LIGHTNING = (
    ("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector",
     "_precision_flag", "Lightning"),
    ("pytorch_lightning.trainer.connectors.accelerator_connector", "_AcceleratorConnector",
     "_precision_flag", "Lightning"),
    ("lightning.fabric.connector", "_Connector", "_precision_input", "Fabric"),
    ("lightning_fabric.connector", "_Connector", "_precision_input", "Fabric"),
)


def install(patcher: Patcher) -> None:
    """Patch the frameworks already imported in this process."""
    deepspeed.install(patcher)
    accelerator = sys.modules.get("accelerate.accelerator")
    cls = getattr(accelerator, "Accelerator", None)
    if isinstance(cls, type):
        patcher.setattr(cls, "__init__", _wrap_accelerator_init(vars(cls)["__init__"]))
    args_cls = getattr(sys.modules.get("transformers.training_args"), "TrainingArguments", None)
    if isinstance(args_cls, type) and "__post_init__" in vars(args_cls):
        patcher.setattr(args_cls, "__post_init__",
                        _wrap_training_args_post_init(vars(args_cls)["__post_init__"]))
    for module_name, class_name in _TRAINING_STEPS:
        owner = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(owner, type) and "training_step" in vars(owner):
            patcher.setattr(owner, "training_step",
                            _wrap_training_step(vars(owner)["training_step"]))
    for module_name, class_name, final, framework in _LIGHTNING:
        connector = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(connector, type):
            patcher.setattr(connector, "__init__",
                            _wrap_lightning_init(vars(connector)["__init__"], framework, final))
