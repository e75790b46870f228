"""The model and optimizer(s) a run trains: built from the spec's factories and checked
usable by the triage (a model it cannot use is refused with the reason, exit 2)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import SpecError, UserCodeError
from ..maths import rng
from ..spec import OptimizerMapping
from .naming import defined_at, factory_name, spec_where, unusable
from .usercode import UserCode


def build_model(code: UserCode, device: torch.device, seed: int) -> torch.nn.Module:
    """The model factory's model, checked (`check_model`) and moved to `device` in fp32."""
    rng.manual_seed(seed)
    model = code.call("the model factory", code.model_factory)
    check_model(code, model)
    moved = code.call(f"moving the model to {device} in float32 (`model.to(...)`)",
                      lambda: model.to(device=device, dtype=torch.float32))
    if not isinstance(moved, torch.nn.Module):
        override = type(model).to
        at = defined_at(override) if override is not torch.nn.Module.to else None
        by = (f" ({type(model).__name__}.to{f' at {at}' if at else ''} overrides "
              "nn.Module.to)" if override is not torch.nn.Module.to else "")
        what = "None" if moved is None else f"a {type(moved).__name__}"
        raise unusable(code.spec, "model", (
            f"{factory_name(code.spec, 'model', code.model_factory)} returned a model whose "
            f"`.to()` returns {what} instead of the module{by}: ampdoctor moves the model with "
            f"`model.to(device=..., dtype=torch.float32)` and uses what it returns, as "
            "`model = model.to(device)` in your training does. Make the override end with "
            "`return super().to(*args, **kwargs)` (or `return self`)."))
    return moved


#: How many parameter names a message lists.
SHOWN_NAMES = 3


def _listed(named: list[tuple[str, torch.Tensor]]) -> str:
    shown = ", ".join(f"`{n or '(tensor)'}` {t.dtype}" for n, t in named[:SHOWN_NAMES])
    more = len(named) - SHOWN_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def _returned(value: Any) -> tuple[str, str]:
    """What a factory returned and what to return instead, for a message."""
    if value is None:
        return "None", " (a missing `return`?)"
    if isinstance(value, type):
        return (f"the class {value.__name__}",
                f": call it and return the instance (`return {value.__name__}(...)`)")
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.nn.Module) for v in value):
        return (f"a {type(value).__name__} holding a module",
                ": return the model alone (the optimizer comes from the spec's `optimizer` key)")
    return f"a {type(value).__name__}", ""


def check_model(code: UserCode, model: Any) -> None:
    """Refuse, with the reason (exit 2), a model the triage cannot use or cannot judge: not a
    module, a TorchScript module (no forward hooks), weights on the meta device (no values),
    complex or reduced-precision (fp16/bf16/fp8) parameters (the fp32 rungs and reference need
    fp32 master weights), no trainable parameters. A factory whose code raises is exit 3."""
    spec = code.spec

    def factory() -> str:   # (only for a message: it reads the factory's source)
        return factory_name(spec, "model", code.model_factory)

    if not isinstance(model, torch.nn.Module):
        what, hint = _returned(model)
        raise unusable(spec, "model", f"{factory()} returned {what}, not a torch.nn.Module"
                       f"{hint or ': return the model itself (an nn.Module)'}.")
    if spec.lightning is not None:
        from .entrypoints import check_lightning_module
        check_lightning_module(spec, model)
    if isinstance(model, torch.jit.ScriptModule):
        raise unusable(spec, "model", (
            f"{factory()} returned a TorchScript module ({type(model).__name__}, from "
            "torch.jit.script or torch.jit.trace): ampdoctor hooks the model's forward to match "
            "each forward to the micro-batch it reads and to align dropout per micro-batch, and "
            "a TorchScript module refuses forward hooks. Return the eager module (the nn.Module "
            "before torch.jit.script/trace): what the triage checks (the loss, the scaler, the "
            "optimizer steps) is in your loop, and the eager model computes the same "
            "gradients."))
    params = code.call("listing the model's parameters (`model.named_parameters()`)",
                       lambda: list(model.named_parameters()))
    buffers = code.call("listing the model's buffers (`model.named_buffers()`)",
                        lambda: list(model.named_buffers()))
    meta = [(n, t) for n, t in params + buffers if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        raise unusable(spec, "model", (
            f"{factory()} returned a model with {len(meta)} tensor(s) on the meta device "
            f"({_listed(meta)}): a meta tensor holds no values (a model built under "
            "`torch.device('meta')` or `init_empty_weights`), so there is nothing to train or "
            "compare. Return the model with real weights: materialise it "
            "(`model.to_empty(device=...)`, then initialise or load the weights) before "
            "returning it."))
    complex_ = [(n, p) for n, p in params if p.is_complex()]
    if complex_:
        raise unusable(spec, "model", (
            f"{factory()} returned a model with {len(complex_)} complex parameter tensor(s) "
            f"({_listed(complex_)}): ampdoctor compares real fp32 weights and gradients with "
            "an fp32 reference, and moving this model to float32 would drop the imaginary "
            "parts. It cannot triage a complex-valued model."))
    # (frozen weights are never updated: a frozen base kept in bf16 under fp32 adapters is
    # moved to fp32 with the rest, as any dtype is)
    trainable = [(n, p) for n, p in params if p.requires_grad]
    low = [(n, p) for n, p in trainable if p.is_floating_point() and p.dtype.itemsize < 4]
    if low:
        dtypes = sorted({str(p.dtype) for _, p in low})
        why = (" Training fp16 weights with no fp32 master copy is a bug of its own: small "
               "updates round away, and GradScaler refuses to unscale fp16 gradients."
               if "torch.float16" in dtypes else
               " If your training keeps its weights in low precision on purpose (pure bf16), "
               "ampdoctor cannot judge it: it triages fp32 weights under autocast.")
        raise unusable(spec, "model", (
            f"{factory()} returned {len(low)} of {len(trainable)} trainable parameter tensor(s) "
            f"in reduced precision ({_listed(low)}): the triage needs fp32 master weights. It "
            "compares every optimizer step with an fp32 reference, so its fp32 rungs must hold "
            "fp32 weights, and the optimizer must update fp32 weights in every precision. Return "
            "the fp32 model (drop `.half()` / `.to(torch.bfloat16)` from the factory): autocast "
            f"makes the low-precision compute, driven by `run.autocast_dtype`.{why}"))
    if not params:
        raise unusable(spec, "model", (
            f"{factory()} returned a model with no parameters ({type(model).__name__}): there is "
            "nothing to optimize or compare. Return the model that holds the weights your loop "
            "trains."))
    if not any(p.requires_grad for _, p in params):
        raise unusable(spec, "model", (
            f"{factory()} built a model with no trainable parameters ({len(params)} parameter "
            "tensor(s), all with requires_grad=False): there is nothing to optimize. Return it "
            "with the parameters your training updates trainable."))


def build_optimizers(code: UserCode,
                     model: torch.nn.Module) -> tuple[Any, list[torch.optim.Optimizer]]:
    """Return (what the loop receives, the flat list of optimizers)."""
    spec_opt = code.spec.optimizer
    if code.optimizer_factory is not None:
        result = code.call("the optimizer factory", code.optimizer_factory, model)
    elif code.spec.lightning is not None and spec_opt is None:
        # the LightningModule's own optimizers; the `lightning` loop hands the same config
        # back to its Trainer
        configure: Any = model.configure_optimizers
        config = code.call("the LightningModule's configure_optimizers", configure)
        return config, lightning_optimizers(config)
    else:
        options: dict[str, Any] = {"name": "SGD", "lr": 0.05}
        if isinstance(spec_opt, OptimizerMapping):   # (a 'module:function' is the factory)
            options = dict(spec_opt.model_dump())
        name = options.pop("name")
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise SpecError(f"{spec_where(code.spec, 'optimizer.name')}spec key 'optimizer.name': "
                            f"torch.optim has no optimizer {name!r}.")
        try:
            result = cls(model.parameters(), **options)
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{spec_where(code.spec, 'optimizer')}spec key 'optimizer': "
                            f"{name}({', '.join(options)}) is not valid: {exc}",
                            cause=exc) from exc
    flat = list(result) if isinstance(result, (list, tuple)) else [result]
    if isinstance(result, dict):
        flat = list(result.values())
    factory = f"the optimizer factory '{code.spec.optimizer}'"
    if not flat:
        raise UserCodeError(f"{factory} returned {result!r}: no optimizer to step.")
    for opt in flat:
        if not isinstance(opt, torch.optim.Optimizer):
            raise UserCodeError(f"{factory} returned a {type(opt).__name__}, not a "
                                "torch.optim.Optimizer (or a list of them).")
    own = {id(p) for p in model.parameters()}
    foreign = [p for opt in flat for group in opt.param_groups for p in group["params"]
               if id(p) not in own]
    if foreign:
        raise UserCodeError(f"{factory} returned an optimizer over {len(foreign)} parameter "
                            "tensor(s) that are not the model's (it builds its own model?): "
                            "the optimizer must take the `model` it is given.")
    return result, flat



def lightning_optimizers(config: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in what `configure_optimizers` may return: one optimizer, a list or
    tuple of them, a dict with an "optimizer" key, a list of such dicts, or
    `([optimizers], [schedulers])`."""
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, dict):
        return lightning_optimizers(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)) \
                and isinstance(config[1], (list, tuple)):
            return lightning_optimizers(config[0])
        return [opt for item in config for opt in lightning_optimizers(item)]
    raise UserCodeError(f"configure_optimizers returned {type(config).__name__}: no "
                        "torch.optim.Optimizer to step.")
