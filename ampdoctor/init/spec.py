"""`ampdoctor init [PY_FILE]`: write a commented starter spec, filled in from what the AST of
PY_FILE offers (the loop, the model and data factories, K, the clip threshold). Never runs the
file, never overwrites a file. No torch here."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import UsageError
from . import loss as init_loss
from . import script as init_script

LOOP_PARAMS = ("model", "optimizer", "micro_batches", "run")
K_NAMES = ("accumulation_steps", "gradient_accumulation_steps", "grad_accum_steps",
           "accum_iter", "accum_steps", "update_freq", "grad_accum")
CLIP_NAMES = ("max_grad_norm", "clip_grad", "grad_clip", "clip_norm", "max_norm")
#: what a spec without `loss` gives up, as init says it
WITHOUT_LOSS = ("without `loss` the reference re-runs your loop at K = 1: it states no intended "
                "weighting, and each step's weights and gradient are kept to be judged after "
                "the run instead of inside its optimizer step")
BATCH_NAMES = ("micro_batch_size", "batch_size", "per_device_train_batch_size")


@dataclass
class Found:
    """What the AST of one file offers, by spec key (None: not found)."""

    module: str
    train_loop: str | None = None
    model: str | None = None
    data: str | None = None
    loss: str | None = None
    optimizer: str | None = None
    accumulation_steps: int | None = None
    max_grad_norm: float | None = None
    micro_batch_size: int | None = None
    #: the script's own torch.optim call, as a spec mapping ({name: AdamW, lr: 0.001})
    optimizer_call: dict | None = None
    #: no loss function in the file: the one init proposes from the loop's own loss
    loss_proposal: init_loss.LossProposal | None = None
    uses_fp16: bool = False
    uses_bf16: bool = False
    notes: list[str] = field(default_factory=list)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def _required(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = fn.args.posonlyargs + fn.args.args
    return len(args) - len(fn.args.defaults)


def _is_module_class(node: ast.ClassDef) -> bool:
    return any((isinstance(b, ast.Attribute) and b.attr == "Module")
               or (isinstance(b, ast.Name) and b.id == "Module") for b in node.bases)


def _constant(node: ast.AST | None) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    return None


def inspect_file(path: Path) -> Found:
    """What the file's AST offers for each spec key (the file is parsed, never run)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read it: {exc}") from exc
    except SyntaxError as exc:
        raise UsageError(f"{path}:{exc.lineno}: not valid Python ({exc.msg}); init reads the "
                         "file's functions without running it.") from exc
    found = Found(module=path.stem)
    _find_functions(found, tree)
    if found.model is None:
        _find_model_class(found, tree)
    for node in ast.walk(tree):
        _find_setting(found, node)
    # what the literals did not give: the defaults of the script's own options
    given = init_script.defaults(path)
    k = given.get("accumulation_steps")
    if found.accumulation_steps is None and k is not None and float(k).is_integer():
        found.accumulation_steps = int(k)
    if found.max_grad_norm is None and "max_grad_norm" in given:
        found.max_grad_norm = float(given["max_grad_norm"])
    if found.micro_batch_size is None and float(given.get("micro_batch_size", 0.5)).is_integer():
        found.micro_batch_size = int(given["micro_batch_size"])
    found.optimizer_call = given.get("optimizer")
    if found.loss is None:
        found.loss_proposal = init_loss.propose(tree)
    return found


def _find_functions(found: Found, tree: ast.Module) -> None:
    """The loop, model, data, loss and optimizer functions, by their parameters and names."""
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for fn in functions:
        params, name = _params(fn), fn.name.lower()
        if found.train_loop is None and len(params) >= 4 and _required(fn) <= 4 and (
                tuple(params[:4]) == LOOP_PARAMS or "train" in name):
            found.train_loop = fn.name
        elif found.model is None and _required(fn) == 0 and "model" in name and (
                name.startswith(("make", "build", "create", "get", "new"))):
            found.model = fn.name
        elif found.data is None and _required(fn) == 0 and any(
                w in name for w in ("data", "batch", "slice", "sample")):
            found.data = fn.name
        elif found.loss is None and len(params) >= 2 and _required(fn) <= 2 and "loss" in name:
            found.loss = fn.name
        elif found.optimizer is None and _required(fn) == 1 and "optim" in name:
            found.optimizer = fn.name


def _find_model_class(found: Found, tree: ast.Module) -> None:
    """An nn.Module class built with no arguments, as the model factory."""
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef)
                     and n.name == "__init__"), None)
        if _is_module_class(cls) and (init is None or _required(init) <= 1):
            found.model = cls.name
            break


def _find_setting(found: Found, node: ast.AST) -> None:
    """K and the clip threshold from an assignment or a clip call; the precisions named."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        _find_assigned(found, node)
    elif isinstance(node, ast.Call):
        # DataLoader(batch_size=8), TrainingArguments(gradient_accumulation_steps=4, ...)
        for keyword in node.keywords:
            if keyword.arg is not None:
                _found_value(found, keyword.arg.lower(), _constant(keyword.value))
        callee = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        if callee in ("clip_grad_norm_", "clip_grads_with_norm_") and found.max_grad_norm is None:
            value = _constant(node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "max_norm"), None))
            if value is not None and value > 0:
                found.max_grad_norm = float(value)
    elif isinstance(node, ast.Attribute) and node.attr in ("float16", "half"):
        found.uses_fp16 = True
    elif isinstance(node, ast.Attribute) and node.attr == "bfloat16":
        found.uses_bf16 = True
    if isinstance(node, ast.Name) and node.id == "GradScaler" or \
            isinstance(node, ast.Attribute) and node.attr == "GradScaler":
        found.uses_fp16 = True


def _find_assigned(found: Found, node: ast.Assign | ast.AnnAssign) -> None:
    """`accumulation_steps = 8`, `max_grad_norm = 1.0` and their usual other names."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    value = _constant(node.value)
    for target in targets:
        named = getattr(target, "id", None) or getattr(target, "attr", None)
        if named is not None:
            _found_value(found, named.lower(), value)


def _found_value(found: Found, name: str, value: float | None) -> None:
    """A literal K, micro-batch size or clip threshold under one of its usual names (the
    first one found stays)."""
    if value is None:
        return
    if name in K_NAMES and found.accumulation_steps is None and value >= 1 \
            and float(value).is_integer():
        found.accumulation_steps = int(value)
    if name in BATCH_NAMES and found.micro_batch_size is None and value >= 1 \
            and float(value).is_integer():
        found.micro_batch_size = int(value)
    if name in CLIP_NAMES and found.max_grad_norm is None and value > 0:
        found.max_grad_norm = float(value)


def starter_spec(found: Found | None, project_root: str) -> str:
    """The commented YAML of a starter spec; what `found` lacks is a TODO to fill in."""
    def ref(attr: str | None, placeholder: str) -> str:
        if found is not None and attr is not None:
            return f"{found.module}:{attr}"
        return placeholder

    def todo(attr: str | None) -> str:
        return "" if found is not None and attr is not None else "   # TODO"

    f = found
    k = f.accumulation_steps if f and f.accumulation_steps else 4
    model, data, loop = (f.model, f.data, f.train_loop) if f else (None, None, None)
    lines = [
        "# ampdoctor spec: what to run, and how much of it.",
        "# Check it with `ampdoctor diagnose THIS_FILE`; every key: docs/spec.md in "
        "ampdoctor's repo.",
        "# Completion in editors: `ampdoctor schema > ampdoctor.schema.json`, then keep this line:",
        "# yaml-language-server: $schema=ampdoctor.schema.json",
        f"name: {f.module if f else 'my-run'}",
        f"project_root: {project_root}          # put first on sys.path; paths are relative to "
        "this file",
        f"model: {ref(model, 'models:make_model')}{todo(model)}"
        "   # () -> nn.Module; ampdoctor seeds before each call",
        f"data: {ref(data, 'data:triage_slice')}{todo(data)}"
        "   # () -> (x, y) tensors cut into micro-batches, or a list of micro-batches",
        f"train_loop: {ref(loop, 'train:train_loop')}{todo(loop)}"
        "   # (model, optimizer, micro_batches, run): your loop, switched by run.precision",
    ]
    if f and f.loss:
        lines.append(f"loss: {f.module}:{f.loss}   # (model, micro_batch) -> loss, or "
                     "(loss_sum, weight_sum): the weighting you intend")
    elif f and f.loss_proposal:
        lines += [f"# loss: {f.module}:{init_loss.NAME}   # proposed: add the function below "
                  f"to {f.module}.py, then uncomment",
                  f"#   ({WITHOUT_LOSS})",
                  *[f"#   {line}" if line else "#" for line in
                    f.loss_proposal.code.rstrip().splitlines()]]
    else:
        lines.append("# loss: models:loss_fn   # optional: (model, micro_batch) -> loss; states "
                     "the weighting you intend")
    if f and f.optimizer:
        lines.append(f"optimizer: {f.module}:{f.optimizer}   # (model) -> optimizer(s)")
    elif f and f.optimizer_call:
        call = f.optimizer_call
        shown = ", ".join(f"{k}: {v}" for k, v in call.items())   # (a class name, a number)
        lines.append(f"optimizer: {{{shown}}}   # as your script builds it; or "
                     "module:fn(model) -> optimizer(s)")
    else:
        lines.append("optimizer: {name: AdamW, lr: 1.0e-3}   # a torch.optim class and its "
                     "arguments, or module:fn(model) -> optimizer(s)")
    lines += [
        f"accumulation_steps: {k}   # K: micro-batches per optimizer step"
        + ("" if f and f.accumulation_steps else "   # TODO: your K"),
        f"micro_batch_size: {f.micro_batch_size if f and f.micro_batch_size else 8}   # b, "
        "when data returns tensors: the slice needs optimizer_steps x K x b samples",
        "optimizer_steps: 3   # optimizer steps per run",
    ]
    if f and f.max_grad_norm:
        lines.append(f"max_grad_norm: {f.max_grad_norm}   # handed to the loop as "
                     "run.max_grad_norm")
    else:
        lines.append("# max_grad_norm: 1.0   # handed to the loop as run.max_grad_norm")
    # all three unless the file only ever names bf16 (a bf16 pipeline has no fp16 rungs)
    precisions = ["fp32", "bf16"] if f is not None and f.uses_bf16 and not f.uses_fp16 \
        else ["fp32", "bf16", "fp16"]
    lines += [
        f"precisions: [{', '.join(precisions)}]   # the precisions your training uses "
        "(fp32 always runs)",
        "device: auto   # auto | cpu | cuda | cuda:N",
        "seed: 0",
        "# ddp: {world_size: 2}   # also check no_sync()/gradient sync over gloo or nccl ranks",
        "",
    ]
    return "\n".join(lines)


def write_starter(target: Path, py_file: Path | None) -> tuple[Path, Found | None]:
    """Write the starter spec to `target` (never over an existing file)."""
    found = None
    if py_file is not None:
        if not py_file.is_file():
            raise UsageError(f"{py_file}: no such Python file.")
        found = inspect_file(py_file)
    base = target.resolve().parent
    root = os.path.relpath(py_file.resolve().parent, base) if py_file is not None else "."
    text = starter_spec(found, root)
    try:
        with open(target, "x", encoding="utf-8") as fh:
            fh.write(text)
    except FileExistsError as exc:
        raise UsageError(f"{target} already exists; init never overwrites a file (give "
                         "another name with -o).") from exc
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc}") from exc
    return target, found
