"""What `ampdoctor init train.py` reads of a script's command line, without running it: its
argparse options with their defaults (`parser.add_argument("--accum-steps", default=4)`), or a
nanoGPT-style module-level configuration overridden as `--key=value`. From those, the
script-mode command line for a script whose loop is inline (no `train_loop` to put in a spec):
`--reference-args` with the accumulation flag set to 1 and the batch flag multiplied by K. No
torch here."""

from __future__ import annotations

import ast
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: option names (dashes as underscores, lower case) that hold K, the micro-batch size, the clip
K_FLAGS = ("accumulation_steps", "gradient_accumulation_steps", "grad_accum_steps",
           "grad_accumulation_steps", "accum_iter", "accum_iters", "accum_steps", "update_freq",
           "grad_accum", "accum", "accumulate", "gradient_accumulation",
           "accumulate_grad_batches", "accumulation", "iters_to_accumulate",
           "gradient_accumulation_iters", "gradient_accumulate_every", "grad_acc_steps",
           "accum_freq", "num_accumulation_steps")
BATCH_FLAGS = ("batch_size", "micro_batch_size", "bs", "per_device_train_batch_size",
               "per_device_batch_size", "per_gpu_train_batch_size", "batch_size_per_device",
               "batch_size_per_gpu", "train_micro_batch_size_per_gpu", "device_batch_size",
               "local_batch_size", "micro_batch", "mini_batch_size", "train_batch_size", "batch")
#: a total (global, effective) batch per optimizer step from which the script derives K itself
#: (build-nanogpt / llm.c: `grad_accum_steps = total_batch_size // (B * T)`)
TOTAL_FLAGS = ("total_batch_size", "global_batch_size", "effective_batch_size", "total_batch",
               "global_batch", "batch_size_total", "tokens_per_step", "total_batch_tokens")
CLIP_FLAGS = ("max_grad_norm", "clip_grad", "grad_clip", "clip_norm", "max_norm", "clip")


@dataclass(frozen=True)
class Flag:
    """One setting of the script's command line and its default."""

    option: str          # as written on the command line: "--batch-size" or "--batch_size"
    name: str            # normalised: "batch_size"
    default: Any
    configurator: bool   # nanoGPT style: passed as --name=value
    #: every option string that sets it ("-b", "--batch-size"); empty: just `option`
    aliases: tuple[str, ...] = ()
    #: argparse's dest when given (`dest="accum"`), normalised
    dest: str | None = None

    @property
    def options(self) -> tuple[str, ...]:
        return self.aliases or (self.option,)

    @property
    def names(self) -> set[str]:
        """Its normalised long option names and dest: what K_FLAGS / BATCH_FLAGS are read by."""
        found = {_normal(o) for o in self.options if o.startswith("--")} | {self.name}
        return found | ({self.dest} if self.dest else set())


def _normal(option: str) -> str:
    return option.lstrip("-").replace("-", "_").lower()


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
               ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b if b else None}


def constant_value(node: ast.AST | None) -> Any:
    """A literal number or string, or arithmetic of literal numbers (nanoGPT's `5 * 8`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = constant_value(node.left), constant_value(node.right)
        if isinstance(left, (int, float)) and isinstance(right, (int, float)):
            return _ARITHMETIC[type(node.op)](left, right)
    return None


def _configurator(tree: ast.Module) -> bool:
    """nanoGPT's configurator: module-level settings overridden through `globals()` from
    sys.argv, inline or exec'd from a configurator.py."""
    source = ast.unparse(tree)
    return "globals()" in source and ("sys.argv" in source or "configurator" in source)


def _argv_option(node: ast.AST) -> tuple[str, Any] | None:
    """`int(sys.argv[sys.argv.index("--accum") + 1]) if "--accum" in sys.argv else 4`: the
    option and its default."""
    if not isinstance(node, ast.IfExp):
        return None
    test = node.test
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Constant)
            and isinstance(test.left.value, str) and test.left.value.startswith("-")
            and "argv" in ast.unparse(test.comparators[0])):
        default = constant_value(node.orelse)
        if default is not None:
            return test.left.value, default
    return None


def _hf_training_arguments(source: str) -> list[Flag]:
    """HfArgumentParser over transformers' TrainingArguments: its options and defaults."""
    if "HfArgumentParser" not in source or "TrainingArguments" not in source:
        return []
    return [Flag("--gradient_accumulation_steps", "gradient_accumulation_steps", 1, False),
            Flag("--per_device_train_batch_size", "per_device_train_batch_size", 8, False)]


def _imported_names(tree: ast.Module, module: str, name: str) -> set[str]:
    """The names `from module import name [as x]` binds."""
    return {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and n.module == module for a in n.names if a.name == name}


def _is_click_option(func: ast.AST, names: set[str]) -> bool:
    """`click.option(...)` / `option(...)` imported from click: options as argparse writes
    them (`"-b", "--batch-size", default=8`)."""
    return ((isinstance(func, ast.Attribute) and func.attr == "option"
             and isinstance(func.value, ast.Name) and func.value.id == "click")
            or (isinstance(func, ast.Name) and func.id in names))


#: libraries that turn a dataclass's fields into options, and how they spell them
_DATACLASS_PARSERS = (("tyro", "-"), ("HfArgumentParser", "_"), ("TrlParser", "_"),
                      ("simple_parsing", "_"), ("jsonargparse", "_"))


def _dataclass_fields(tree: ast.Module, source: str) -> list[Flag]:
    """The int fields of the script's dataclasses, where a library that makes options of them
    is used (`--batch_size` for HfArgumentParser, `--batch-size` for tyro), with their
    defaults (`batch_size: int = 8`, `field(default=8)`)."""
    dash = next((d for library, d in _DATACLASS_PARSERS if library in source), None)
    if dash is None:
        return []
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and any(
                "dataclass" in ast.unparse(d) for d in node.decorator_list)):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                value = item.value
                if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                default = constant_value(value)
                if isinstance(default, int):
                    name = item.target.id
                    found.append(Flag("--" + name.replace("_", dash), name.lower(), default,
                                      False, _spellings(name, dash)))
    return found


def _spellings(name: str, dash: str) -> tuple[str, ...]:
    """The option strings a library reads for a field or parameter `name`: `--batch-size`
    alone where it writes dashes (typer, tyro), else `--batch_size` and, as HfArgumentParser
    and fire also read it, `--batch-size`."""
    hyphen = "--" + name.replace("_", "-")
    if dash == "-":
        return (hyphen,)
    return ("--" + name,) + ((hyphen,) if hyphen != "--" + name else ())


def _function_options(tree: ast.Module, undefaulted: bool) -> list[Flag]:
    """The parameters of a function a CLI library calls with options made of them:
    `fire.Fire(main)` (`--batch_size`), `typer.run(main)` or `@app.command()` (`--batch-size`,
    or the names given to `typer.Option`), their defaults literal or `typer.Option(8)`."""
    entry: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name):
            called = ast.unparse(node.func)
            if called in ("fire.Fire", "Fire"):
                entry[node.args[0].id] = "_"
            elif called == "typer.run":
                entry[node.args[0].id] = "-"
        elif isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).endswith(".command()") for d in node.decorator_list):
            entry.setdefault(node.name, "-")
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.FunctionDef) and node.name in entry):
            continue
        positional = node.args.posonlyargs + node.args.args
        params = positional + node.args.kwonlyargs
        values = ([None] * (len(positional) - len(node.args.defaults))
                  + list(node.args.defaults) + list(node.args.kw_defaults))
        for param, value in zip(params, values, strict=True):
            options: list[str] = []
            if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("Option"):
                options = [a.value for a in value.args if isinstance(a, ast.Constant)
                           and isinstance(a.value, str) and a.value.startswith("-")]
                value = next((k.value for k in value.keywords if k.arg == "default"),
                             value.args[0] if value.args else None)
            default = constant_value(value)
            if isinstance(default, int) or (undefaulted and default is None):
                name = param.arg
                spelled = _spellings(name, entry[node.name])
                option = ([o for o in options if o.startswith("--")] or list(spelled))[0]
                found.append(Flag(option, name.lower(), default, False,
                                  tuple(options) or spelled))
    return found


def flags(tree: ast.Module, undefaulted: bool = False) -> list[Flag]:
    """The script's argparse options with a literal default (`undefaulted`: those without one
    too, default None), `"--x" in sys.argv` options, else (a module-level configuration
    overridden from sys.argv through `globals()`) its module-level literal settings."""
    found: list[Flag] = []
    clicks = _imported_names(tree, "click", "option")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (
                getattr(node.func, "attr", None) == "add_argument"
                or _is_click_option(node.func, clicks)):
            options = [a.value for a in node.args if isinstance(a, ast.Constant)
                       and isinstance(a.value, str) and a.value.startswith("-")]
            default = next((constant_value(k.value) for k in node.keywords if k.arg == "default"),
                           None)
            dest = next((k.value.value for k in node.keywords if k.arg == "dest"
                         and isinstance(k.value, ast.Constant)
                         and isinstance(k.value.value, str)), None)
            long = [o for o in options if o.startswith("--")] or options
            if long and (default is not None or undefaulted):
                found.append(Flag(long[0], _normal(long[0]), default, False, tuple(options),
                                  _normal(dest) if dest else None))
        elif isinstance(node, ast.Assign) and (argv := _argv_option(node.value)) is not None:
            found.append(Flag(argv[0], _normal(argv[0]), argv[1], False))
    source = ast.unparse(tree)
    found += _hf_training_arguments(source)
    found += _dataclass_fields(tree, source) + _function_options(tree, undefaulted)
    if found:
        return found
    if _configurator(tree):
        found = configuration(tree)
    return found


def configuration(tree: ast.Module) -> list[Flag]:
    """The module-level literal settings of a nanoGPT-style script or config file."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            value = constant_value(node.value)
            if value is not None:
                name = node.targets[0].id
                found.append(Flag(f"--{name}", name.lower(), value, True))
    return found


def find(all_flags: list[Flag], names: tuple[str, ...]) -> Flag | None:
    for wanted in names:
        for flag in all_flags:
            if wanted in flag.names and isinstance(flag.default, (int, float)):
                return flag
    return None


def has_inline_loop(tree: ast.Module) -> bool:
    """The script calls .backward() itself (its loop is inline, not a train_loop function)."""
    return any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "backward"
               for n in ast.walk(tree))


def _arg(flag: Flag, value: Any) -> list[str]:
    return [f"{flag.option}={value}"] if flag.configurator else [flag.option, str(value)]


def reference_args(all_flags: list[Flag]) -> tuple[list[str] | None, str]:
    """The arguments of the fp32 full-batch reference (K = 1, batch K x b) from the defaults,
    and what was read (or what is missing)."""
    k, batch = find(all_flags, K_FLAGS), find(all_flags, BATCH_FLAGS)
    if k is None or batch is None:
        missing = " and ".join(w for w, f in (("the accumulation steps", k),
                                               ("the batch size", batch)) if f is None)
        return None, f"no option with a default for {missing} was found"
    K, b = int(k.default), int(batch.default)
    return _arg(k, 1) + _arg(batch, K * b), (f"{k.option} defaults to {K}, {batch.option} to "
                                             f"{b}: the reference is K = 1, batch {K * b}")


def script_command(path: Path, shown: str) -> tuple[str, str] | None:
    """For a script with an inline loop: the script-mode command line (with --reference-args
    when the defaults give them) and a line on how it was made; None for any other file."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return None
    if not has_inline_loop(tree):
        return None
    args, how = reference_args(flags(tree))
    if args is None:
        return (f"ampdoctor diagnose {shlex.quote(shown)} -- ARGS",
                how + ": add --reference-args \"...\" with your arguments for one micro-batch "
                "per optimizer step holding the whole step's data (K = 1, batch K x b)")
    ref = shlex.quote(" ".join(args))
    return f"ampdoctor diagnose {shlex.quote(shown)} --reference-args {ref} --", how


#: torch.optim classes `init` recognises in a script's own optimizer call
OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam",
              "RAdam", "LBFGS", "ASGD", "Rprop", "SparseAdam", "Adafactor")


def optimizer(tree: ast.Module, all_flags: list[Flag]) -> dict[str, Any] | None:
    """The script's `torch.optim.X(params, lr=...)` as a spec's `{name: X, lr: ...}`: the lr a
    literal or an option's default (`lr=args.lr`, `lr=learning_rate`)."""
    by_name = {f.name: f.default for f in all_flags}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in OPTIMIZERS):
            continue
        found: dict[str, Any] = {"name": node.func.attr}
        lr = next((k.value for k in node.keywords if k.arg == "lr"), None)
        value = constant_value(lr)
        if value is None and lr is not None:
            named = getattr(lr, "attr", None) or getattr(lr, "id", None)
            value = by_name.get(_normal(named)) if named else None
        if isinstance(value, (int, float)):
            found["lr"] = value
        return found
    return None


def defaults(path: Path) -> dict[str, Any]:
    """K, the micro-batch size and the clip threshold from the script's option defaults."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return {}
    all_flags = flags(tree)
    out: dict[str, Any] = {}
    for key, names in (("accumulation_steps", K_FLAGS), ("micro_batch_size", BATCH_FLAGS),
                       ("max_grad_norm", CLIP_FLAGS)):
        flag = find(all_flags, names)
        if flag is not None and flag.default > 0:
            out[key] = flag.default
    found = optimizer(tree, all_flags)
    if found is not None:
        out["optimizer"] = found
    return out
