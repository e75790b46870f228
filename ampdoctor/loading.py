"""Import the user's callables and build model, optimizer(s) and micro-batches from the spec.

A name that cannot be found is the spec's fault (SpecError, exit 2); user code that raises
while it is imported or called is the user's (UserCodeError, exit 3, with their file:line).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import rng
from .errors import (
    AmpdoctorError,
    AmpdoctorInterrupt,
    InputError,
    SpecError,
    UserCodeError,
)
from .probe.callsite import CallSiteFinder
from .safetext import MESSAGE_LIMIT, cut
from .spec import Spec, spec_line


@dataclass(frozen=True)
class RunSettings:
    """The read-only `run` handed to `train_loop` (CONTRACT §2)."""

    precision: str
    device: torch.device
    device_type: str
    autocast_dtype: torch.dtype | None
    accumulation_steps: int
    max_grad_norm: float | None
    rank: int = 0
    world_size: int = 1
    micro_batch_size: int | None = None
    optimizer_steps: int = 1


AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def spec_where(spec: Spec, key: str) -> str:
    """`spec.yaml:LINE: ` for a message about `key` (the file alone when the line is unknown;
    nothing for a spec that has no file)."""
    if spec.spec_path is None:
        return ""
    line = spec_line(spec, key) or (spec_line(spec, key.split(".")[0]) if "." in key else None)
    path = _shown(spec.spec_path)
    return f"{path}:{line}: " if line else f"{path}: "


def _shown(path: Any) -> str:
    """A path as messages show it: relative to the working directory when under it."""
    import os
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def resolve_device(name: str, spec: Spec | None = None) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    where = spec_where(spec, "device") if spec is not None else ""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecError(f"{where}spec key 'device': {name!r} was asked for but this machine has "
                        "no CUDA device; use 'auto' or 'cpu'.")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise SpecError(f"{where}spec key 'device': {name!r} was asked for but this machine has "
                        f"{torch.cuda.device_count()} CUDA device(s).")
    return device


def _user_error(what: str, exc: BaseException, finder: CallSiteFinder) -> UserCodeError:
    site = finder.from_traceback(exc.__traceback__)
    location = (site.file, site.line) if site else None
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        # the error is in the file being compiled, which no traceback frame shows
        location = (os.path.realpath(exc.filename), exc.lineno)
    where = f" at {location[0]}:{location[1]}" if location else ""
    one_line = cut(traceback.format_exception_only(type(exc), exc)[-1].strip(), MESSAGE_LIMIT)
    return UserCodeError(f"{what} raised{where}: {one_line}", cause=exc, location=location)


def unusable(spec: Spec, key: str, message: str, *,
             cause: BaseException | None = None) -> AmpdoctorError:
    """The spec's model or data cannot be used by the triage (exit 2): what the factory named by
    `key` returned, and why. Raised once the spec was loaded, by the factory's own answer (a
    meta-device model, half-precision weights, sparse data...), not because its code raised
    (that is a UserCodeError, exit 3). An InputError names the spec key and its YAML line, and
    is recorded (a bad spec itself is not)."""
    return InputError(f"{spec_where(spec, key)}spec key '{key}': {message}", cause=cause)


def defined_at(fn: Any) -> str | None:
    """`file:line` of a callable's `def` (relative to the working directory when under it), or
    None for one without Python source (a builtin, a C extension)."""
    import inspect
    try:
        target = inspect.unwrap(fn)
        file = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (OSError, TypeError, ValueError):
        return None
    return f"{_shown(file)}:{line}" if file else None


def factory_name(spec: Spec, key: str, fn: Any = None) -> str:
    """How a message names the spec's factory: `the model factory 'models:make' (models.py:12)`.
    Without `fn`, the callable is looked up among the modules already imported (never
    importing anything)."""
    what = {"model": "the model factory", "data": "the data factory"}.get(key, f"'{key}'")
    if fn is None:
        fn = _imported_callable(spec, key)
    at = defined_at(fn) if fn is not None else None
    return f"{what} '{getattr(spec, key)}'" + (f" ({at})" if at else "")


def _imported_callable(spec: Spec, key: str) -> Any:
    given = spec.callable_for(key)
    if given is not None:
        return given
    ref = getattr(spec, key, None)
    if not isinstance(ref, str):
        return None
    module_name, _, attr_path = ref.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in attr_path.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    return obj if callable(obj) else None


#: What each spec callable is called with (CONTRACT: the train_loop signature).
CALLED_WITH = {"model": (), "data": (), "loss": ("model", "micro_batch"),
               "optimizer": ("model",),
               "train_loop": ("model", "optimizer", "micro_batches", "run")}


def _check_signature(key: str, ref: str, fn: Callable[..., Any]) -> None:
    """A callable that cannot take what ampdoctor passes is named at its `def` line now, not
    as a TypeError deep inside a rung."""
    import inspect

    args = CALLED_WITH[key]
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as exc:
        try:
            target = inspect.unwrap(fn)
            file = inspect.getsourcefile(target)
            line = inspect.getsourcelines(target)[1]
        except (OSError, TypeError):
            file, line = None, None
        at = f" at {file}:{line}" if file else ""
        wanted = f"({', '.join(args)})"
        raise UserCodeError(f"spec key '{key}': '{ref}'{at} cannot be called as {ref}{wanted}: "
                            f"{exc}.", location=(file, line) if file else None) from exc
    except ValueError:   # a builtin without a signature: let the call decide
        pass


class UserCode:
    """The user's callables, imported once per diagnose."""

    def __init__(self, spec: Spec, finder: CallSiteFinder):
        self.spec = spec
        self.finder = finder
        #: process-wide settings a run of the loop left changed (restored after each run)
        self.left_behind: set[str] = set()
        self._imported_before = set(sys.modules)
        # ampdoctor never writes into the user's tree: no __pycache__ for what it imports
        self._wrote_bytecode = sys.dont_write_bytecode
        sys.dont_write_bytecode = True
        root = str(spec.root)
        if root not in sys.path:
            sys.path.insert(0, root)
            self._added_path: str | None = root
        else:
            self._added_path = None
        try:
            self.model_factory = self.resolve("model")
            self.data_factory = self.resolve("data")
            self.train_loop = self.resolve("train_loop")
            self.loss = self.resolve("loss") if spec.loss else None
            self.optimizer_factory = (self.resolve("optimizer")
                                      if isinstance(spec.optimizer, str) else None)
        except BaseException:
            self.forget()    # an import that failed leaves no path entry and no module behind
            raise

    def resolve(self, key: str) -> Callable[..., Any]:
        ref: str = getattr(self.spec, key)
        given = self.spec.callable_for(key)
        if given is not None:   # a Spec built in code: the object itself, nothing to import
            _check_signature(key, ref, given)
            return given
        module_name, _, attr_path = ref.partition(":")
        where = spec_where(self.spec, key).rstrip(": ")
        limit = sys.getrecursionlimit()
        try:
            try:
                module = importlib.import_module(module_name)
            finally:
                restore_recursion_limit(limit)   # a module that lowers it on import
        except ModuleNotFoundError as exc:
            missing = exc.name or module_name
            if missing == module_name or module_name.startswith(missing + "."):
                raise SpecError(
                    f"{where}: spec key '{key}': module '{module_name}' was not found under "
                    f"project_root {self.spec.root} (nor on sys.path).", cause=exc) from exc
            raise _user_error(f"importing '{module_name}' (spec key '{key}')", exc,
                              self.finder) from exc
        except BaseException as exc:  # the user's module raised while imported
            if isinstance(exc, (KeyboardInterrupt, AmpdoctorInterrupt)):
                raise
            raise _user_error(f"importing '{module_name}' (spec key '{key}')", exc,
                              self.finder) from exc
        obj: Any = module
        for part in attr_path.split("."):
            if not hasattr(obj, part):
                names = [n for n in dir(module) if not n.startswith("_")]
                import difflib
                close = difflib.get_close_matches(part, names, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise SpecError(f"{where}: spec key '{key}': module '{module_name}' has no "
                                f"attribute '{attr_path}'.{hint}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise SpecError(f"{where}: spec key '{key}': '{ref}' is a "
                            f"{type(obj).__name__}, not a callable.")
        _check_signature(key, ref, obj)
        return obj

    def source_files(self) -> list[str]:
        """The files that define the spec's callables (the diagnosed loop's own path)."""
        import inspect
        files = []
        for fn in (self.train_loop, self.model_factory, self.data_factory, self.loss,
                   self.optimizer_factory):
            if fn is None:
                continue
            try:
                path = inspect.getsourcefile(inspect.unwrap(fn))
            except TypeError:
                path = None
            if path:
                files.append(path)
        return files

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        limit = sys.getrecursionlimit()
        try:
            return fn(*args)
        except BaseException as exc:
            restore_recursion_limit(limit)   # before ampdoctor formats the error
            if isinstance(exc, (KeyboardInterrupt, AmpdoctorInterrupt)):
                raise
            raise _user_error(what, exc, self.finder) from exc
        finally:
            restore_recursion_limit(limit)

    def forget(self) -> None:
        """Drop the modules this diagnose imported and its sys.path entry."""
        root = str(self.spec.root)   # a property that resolves the path: read once
        # A project root that holds its virtual environment holds torch too: what a package
        # imported before the run (torch, ampdoctor) loaded lazily during it stays, as does
        # anything installed (torch registers its operator libraries once per process and
        # refuses a second import).
        packages = {name.partition(".")[0] for name in self._imported_before}
        installed = _installed_prefixes()
        for name in set(sys.modules) - self._imported_before:
            if name.partition(".")[0] in packages:
                continue
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None) or ""
            if path.startswith(root) and not os.path.realpath(path).startswith(installed):
                del sys.modules[name]
        if self._added_path and self._added_path in sys.path:
            sys.path.remove(self._added_path)
        sys.dont_write_bytecode = self._wrote_bytecode


def restore_recursion_limit(limit: int) -> None:
    """Put back the recursion limit the user's code changed (`sys.setrecursionlimit(50)` in a
    loop would otherwise fail ampdoctor's own code after it: the judge, the report). Restored
    silently: the limit changes no number the triage compares."""
    if sys.getrecursionlimit() != limit:
        sys.setrecursionlimit(limit)


def _installed_prefixes() -> tuple[str, ...]:
    """Where installed packages live (site-packages, the standard library) and ampdoctor."""
    import site
    import sysconfig
    paths = sysconfig.get_paths()
    found = {paths.get("purelib"), paths.get("platlib"), paths.get("stdlib"),
             paths.get("platstdlib"), str(Path(__file__).resolve().parent)}
    try:
        found |= set(site.getsitepackages()) | {site.getusersitepackages()}
    except AttributeError:   # a virtualenv's old site module
        pass
    return tuple(os.path.realpath(p) + os.sep for p in found if p)


# --- model and optimizer -----------------------------------------------------------------

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


def build_optimizers(code: UserCode, model: torch.nn.Module) -> tuple[Any, list[torch.optim.Optimizer]]:
    """Return (what the loop receives, the flat list of optimizers)."""
    spec_opt = code.spec.optimizer
    if code.optimizer_factory is not None:
        result = code.call("the optimizer factory", code.optimizer_factory, model)
    else:
        options = {"name": "SGD", "lr": 0.05}
        if spec_opt is not None:
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


# --- data ----------------------------------------------------------------------------------

def _is_tensor_tuple(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(
        isinstance(t, torch.Tensor) for t in value)


def _is_micro_batch(value: Any) -> bool:
    if isinstance(value, dict):
        return len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value.values())
    return _is_tensor_tuple(value)


def _unusable_tensor(t: torch.Tensor) -> tuple[str, str] | None:
    """Why ampdoctor cannot use a tensor of the data slice, as (what it is, why and what to do),
    or None. ampdoctor cuts the slice into micro-batches, copies them to the device,
    concatenates a window's for the reference and matches each forward to its micro-batch by
    the tensor's storage: it needs dense tensors that hold values. (Integer and bool tensors
    are fine: token ids, labels, masks.)"""
    if t.is_meta:
        return ("on the meta device",
                ("a meta tensor holds no values, so nothing can be trained or compared. Return "
                 "real tensors (on the CPU or the GPU)"))
    if t.is_nested:
        return ("as a nested tensor (torch.nested)",
                ("ampdoctor cuts, concatenates and matches micro-batches by their dense "
                 "storage. Return padded dense tensors (`t.to_padded_tensor(0)`), or a list of "
                 "micro-batches whose tensors may differ in length from one micro-batch to the "
                 "next"))
    if t.layout != torch.strided:
        return (f"as a sparse tensor (layout {t.layout})",
                ("ampdoctor cuts the slice into micro-batches, concatenates a window's "
                 "micro-batches for its reference and matches each forward to its micro-batch "
                 "by the tensor's storage, none of which a sparse tensor supports. Return dense "
                 "tensors (`t.to_dense()`); a model that wants sparse input can convert in its "
                 "forward"))
    if t.is_quantized:
        return ("as a quantized tensor",
                ("autocast and the fp32 reference need real values. Return the float tensor "
                 "(`t.dequantize()`)"))
    return None


def _check_tensors(spec: Spec, factory: str, named: list[tuple[str, Any]]) -> None:
    for where, t in named:
        if not isinstance(t, torch.Tensor):
            continue
        why = _unusable_tensor(t)
        if why is not None:
            shape = "" if t.is_nested else f", shape {tuple(t.shape)}"
            raise unusable(spec, "data", f"{factory} returned {where} ({t.dtype}{shape}) "
                           f"{why[0]}: {why[1]}.")


def _field_name(key: Any) -> str:
    return f"field {key!r}" if isinstance(key, str) else f"field {key}"


def cut_micro_batches(data: Any, spec: Spec, factory_fn: Any = None) -> list[Any]:
    """Cut the slice into exactly optimizer_steps * K micro-batches (CONTRACT §1 `data`).
    A slice ampdoctor cannot use (the wrong structure, meta, sparse, nested or quantized
    tensors) is refused naming the data factory, the micro-batch and the field (exit 2)."""
    needed = spec.optimizer_steps * spec.accumulation_steps
    factory = factory_name(spec, "data", factory_fn)
    if _is_tensor_tuple(data):
        tensors = list(data)
        _check_tensors(spec, factory, [(f"tensor {i} of the slice", t)
                                       for i, t in enumerate(tensors)])
        length = tensors[0].shape[0] if tensors[0].dim() > 0 else 0
        if any(t.dim() == 0 or t.shape[0] != length for t in tensors):
            raise unusable(spec, "data", f"{factory} returned tensors whose first dimensions "
                           f"differ ({[tuple(t.shape) for t in tensors]}); a slice of tensors "
                           "must share its first (sample) dimension.")
        b = spec.micro_batch_size
        if b is None:
            raise SpecError(f"{spec_where(spec, 'micro_batch_size')}spec key "
                            "'micro_batch_size': required because the data factory returns a "
                            "tuple of tensors that ampdoctor cuts into micro-batches.")
        if length < needed * b:
            raise SpecError(f"{spec_where(spec, 'micro_batch_size')}spec key "
                            f"'micro_batch_size': the data slice holds {length} "
                            f"samples but optimizer_steps x accumulation_steps x "
                            f"micro_batch_size = {spec.optimizer_steps} x "
                            f"{spec.accumulation_steps} x {b} = {needed * b} are needed.")
        return [tuple(t[i * b:(i + 1) * b] for t in tensors) for i in range(needed)]
    if isinstance(data, (list, tuple)) and data and all(_is_micro_batch(m) for m in data):
        if len(data) < needed:
            raise SpecError(f"{spec_where(spec, 'optimizer_steps')}spec key "
                            f"'optimizer_steps': the data factory returned "
                            f"{len(data)} micro-batches but optimizer_steps x "
                            f"accumulation_steps = {needed} are needed.")
        _check_tensors(spec, factory, [
            (f"micro-batch {index}, {_field_name(key)}", t)
            for index, mb in enumerate(data[:needed])
            for key, t in (mb.items() if isinstance(mb, dict) else enumerate(mb))])
        return [dict(m) if isinstance(m, dict) else tuple(m) for m in data[:needed]]
    hint = ""
    if isinstance(data, torch.Tensor):
        hint = " To give one tensor, return it in a tuple: `return (x,)`."
    elif hasattr(data, "__iter__") and not isinstance(data, (list, tuple, dict)):
        hint = (f" To use a {type(data).__name__}, return its first batches as a list: "
                f"`list(itertools.islice(loader, {needed}))`.")
    raise unusable(spec, "data", (
        f"{factory} must return a tuple/list of tensors with the same first dimension, or a "
        "list of micro-batches (tuples or dicts of tensors); it returned "
        f"{'None' if data is None else 'a ' + type(data).__name__}.{hint}"))


def check_finite(micro_batches: list[Any]) -> None:
    for index, mb in enumerate(micro_batches):
        values = mb.items() if isinstance(mb, dict) else enumerate(mb)
        for key, tensor in values:
            if not (tensor.is_floating_point() or tensor.is_complex()):
                continue
            if not _all_finite(tensor):
                raise UserCodeError(
                    f"the data slice has NaN/inf in micro-batch {index} (field {key!r}): the "
                    "fp32 baseline itself would not be finite, so no comparison means anything. "
                    "Give ampdoctor a finite slice.")


def _all_finite(tensor: torch.Tensor) -> bool:
    try:
        return bool(torch.isfinite(tensor).all())
    except (RuntimeError, NotImplementedError):   # no isfinite kernel (float8): upcast
        return bool(torch.isfinite(tensor.float()).all())


def to_device(mb: Any, device: torch.device) -> Any:
    if isinstance(mb, dict):
        return {k: v.to(device) for k, v in mb.items()}
    return tuple(t.to(device) for t in mb)


def merge_micro_batches(mbs: list[Any]) -> Any | None:
    """One micro-batch holding a whole window's data (for the loop-as-reference at K = 1), or
    None when the micro-batches cannot be concatenated (different sequence lengths)."""
    first = mbs[0]
    try:
        if isinstance(first, dict):
            return {k: torch.cat([mb[k] for mb in mbs]) for k in first}
        return tuple(torch.cat([mb[i] for mb in mbs]) for i in range(len(first)))
    except (RuntimeError, KeyError, IndexError):
        return None


def micro_batch_size_of(mb: Any) -> int:
    tensors = list(mb.values()) if isinstance(mb, dict) else list(mb)
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1


def micro_batch_counts(mb: Any) -> dict[str, float]:
    """What a loss might average over in one micro-batch, by description: its samples, the
    elements of each multi-dimensional tensor, the labels of an integer tensor that are not
    -100 (as given, and shifted for next-token prediction: `[:, 1:]`), the ones of a 0/1 mask.
    Fields named like labels/targets come first: what a loss counts is most often its targets."""
    fields = list(mb.items()) if isinstance(mb, dict) else list(enumerate(mb))
    fields.sort(key=lambda kv: not (isinstance(kv[0], str)
                                    and any(w in kv[0].lower() for w in ("label", "target"))))
    counts: dict[str, float] = {"samples": float(micro_batch_size_of(mb))}
    for key, t in fields:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        name = f"`{key}`" if isinstance(key, str) else f"field {key}"
        shape = " x ".join(str(d) for d in t.shape)
        if t.dim() > 1:
            counts[f"elements of {name} ({shape})"] = float(t.numel())
        if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):  # labels
            kept = float((t != -100).sum())
            if kept != t.numel():
                counts[f"labels of {name} that are not -100"] = kept
            if t.dim() == 2 and t.shape[1] > 1:
                counts[f"next-token targets of {name}[:, 1:]"] = float((t[:, 1:] != -100).sum())
        if t.dtype == torch.bool or ("mask" in str(key).lower() and not t.is_complex()
                                     and bool(((t == 0) | (t == 1)).all())):
            counts[f"ones of the mask {name}"] = float(t.sum())
    return counts


def run_train_loop(code: UserCode, model: Any, optimizer: Any, feed: Any, settings: Any) -> bool:
    """Call the user's train_loop; a generator function (one that yields metrics) runs only
    when iterated, so iterate it to the end. True when it was a generator."""
    import inspect

    from . import progress
    from .process_state import LOOP_SCOPE, ProcessState
    progress.run_started(settings.precision, settings.optimizer_steps)
    limit = sys.getrecursionlimit()
    # what the loop leaves behind (autocast entered, grad mode off, a chdir) must not reach
    # the next run or the reference
    kept = ProcessState.take(LOOP_SCOPE)
    try:
        result = code.train_loop(model, optimizer, feed, settings)
        if not inspect.isgenerator(result):
            return False
        for _ in result:
            pass
        return True
    finally:
        restore_recursion_limit(limit)
        code.left_behind.update(kept.restore())
