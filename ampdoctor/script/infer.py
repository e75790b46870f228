"""The fp32 full-batch reference command line of a script, inferred from the script itself when
no `--reference-args` is given: the option that sets K (argparse `--gradient_accumulation_steps`,
`--grad-accum`, `--accum_iter`, ..., or nanoGPT's module-level `gradient_accumulation_steps`
overridden as `--key=value`) set to 1, and the micro-batch option multiplied by K, their values
read from the script's own ARGS when given there (`--opt V`, `--opt=V`, `-o V`, `-oV`, an
unambiguous prefix of a long option as argparse reads it), else from the option's default
(`init_script` reads the options without running the script).

Where it cannot infer one, a UsageError (exit 2) that says why and gives the command line to
try, with what could be read filled in.
"""

from __future__ import annotations

import ast
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..init import script as init_script
from ..init.script import BATCH_FLAGS, K_FLAGS, TOTAL_FLAGS, Flag


@dataclass(frozen=True)
class Inferred:
    """A reference command line inferred from the script."""

    #: the reference's whole argument list (the run's ARGS with the two options changed)
    args: list[str]
    #: e.g. "--accum-steps 1 --batch-size 32 (inferred)"
    text: str
    #: how it was read: "--accum-steps 4 (ARGS) -> 1, --batch-size 8 (default) -> 32"
    how: str
    K: int
    micro_batch: int
    k_option: str
    batch_option: str
    #: always True here: a reference given with --reference-args is not an Inferred
    inferred: bool = True
    #: where each of the two values came from: "args", "default" or "config FILE"
    sources: dict[str, str] = field(default_factory=dict)
    #: the script derives K from a total batch (`k_option`): `args` are the run's own, and the
    #: batch option is set to K x b once the first fp32 step shows K (`references.deferred`)
    deferred: bool = False
    #: literals of the script changed in the reference's runs: (role "K" or "batch", name, line,
    #: column, new value) (`constants`: K and the micro-batch written in the script)
    rewrites: list[tuple[str, str, int, int, int]] = field(default_factory=list)

    def to_record(self) -> dict[str, Any]:
        """The record's description of the reference (`reference_inferred`)."""
        return {"inferred": self.inferred, "args": list(self.args), "text": self.text,
                "how": self.how, "K": self.K, "micro_batch": self.micro_batch,
                "k_option": self.k_option, "batch_option": self.batch_option,
                "sources": dict(self.sources)}


@dataclass
class _Given:
    """Where an option is set in ARGS: (index, form) per occurrence, the last value."""

    at: list[tuple[int, str, str]] = field(default_factory=list)   # (index, form, option)
    value: str | None = None


def _long_options(all_flags: list[Flag]) -> list[str]:
    return [o for f in all_flags for o in f.options if o.startswith("--")]


def _occurrences(flag: Flag, args: list[str], longs: list[str]) -> _Given:
    """Every place ARGS sets `flag`, as argparse reads them (the last one wins)."""
    given = _Given()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        for option in flag.options:
            key = arg.split("=", 1)[0]
            if not flag.configurator and key.startswith("--") and key != option and \
                    option.startswith(key) and key not in longs and \
                    [o for o in longs if o.startswith(key)] == [option]:
                key = option                       # argparse's unambiguous abbreviation
            if key == option and "=" in arg:
                given.at.append((i, "joined", arg.split("=", 1)[0]))
                given.value = arg.split("=", 1)[1]
            elif key == option and not flag.configurator and i + 1 < len(args):
                given.at.append((i, "separate", arg))
                given.value = args[i + 1]
                i += 1
            elif (len(option) == 2 and option[0] == "-" and option[1] != "-"
                  and arg.startswith(option) and len(arg) > 2):
                given.at.append((i, "attached", option))
                given.value = arg[2:]
            else:
                continue
            break
        i += 1
    return given


def _number(text: Any, what: str) -> int:
    try:
        value = float(text) if isinstance(text, str) else float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what} is {text!r}, not a number") from None
    if value != int(value) or value < 1:
        raise ValueError(f"{what} is {text!r}, not a positive whole number")
    return int(value)


def _set(args: list[str], flag: Flag, given: _Given, value: int) -> list[str]:
    """ARGS with every occurrence of `flag` set to `value`, or it appended when absent."""
    out = list(args)
    if not given.at:
        return out + ([f"{flag.option}={value}"] if flag.configurator
                      else [flag.option, str(value)])
    for index, form, option in given.at:
        if form == "joined":
            out[index] = f"{option}={value}"
        elif form == "separate":
            out[index + 1] = str(value)
        else:
            out[index] = f"{option}{value}"
    return out


def _config_files(args: list[str], cwd: str) -> list[tuple[str, list[Flag]]]:
    """nanoGPT's configurator also execs each ARG without `=` as a config file (in order)."""
    found = []
    for arg in args:
        if arg.startswith("-") or "=" in arg or not arg.endswith(".py"):
            continue
        path = Path(cwd, arg)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (OSError, UnicodeDecodeError, SyntaxError):
            continue
        found.append((arg, init_script.configuration(tree)))
    return found


def _to_try(script: str, args: list[str], k: Flag | None, batch: Flag | None,
            K: int | None, b: int | None) -> str:
    """The command line to try when the reference cannot be inferred."""
    ref: list[str] = []
    k_text = k.option if k is not None else "ACCUM-OPTION"
    b_text = batch.option if batch is not None else "BATCH-OPTION"
    configurator = any(f is not None and f.configurator for f in (k, batch))
    total = str(K * b) if K is not None and b is not None else "K_x_MICRO_BATCH"
    for option, value in ((k_text, "1"), (b_text, total)):
        ref += [f"{option}={value}"] if configurator else [option, value]
    run = shlex.join(args) if args else "ARGS"
    return (f"ampdoctor diagnose {shlex.quote(script)} --reference-args "
            f"{shlex.quote(shlex.join(ref))} -- {run}")


#: the deferred "batch option" of a script that builds a DeepSpeed engine: K and the micro-batch
#: are its config's, the reference's engine is built with K = 1 and K x b (`script.deepspeed`)
DEEPSPEED_BATCH = "train_micro_batch_size_per_gpu"


def builds_deepspeed_engine(tree: ast.AST | str) -> bool:
    """Whether the script (its tree, or its path) calls `deepspeed.initialize` (through any
    name `deepspeed` is imported as, or `from deepspeed import initialize`)."""
    if isinstance(tree, str):
        try:
            tree = ast.parse(Path(tree).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            return False
    names, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name == "deepspeed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "deepspeed":
            functions |= {a.asname or a.name for a in node.names if a.name == "initialize"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "initialize" and isinstance(
                    func.value, ast.Name) and func.value.id in names:
                return True
            if isinstance(func, ast.Name) and func.id in functions:
                return True
    return False


def infer_reference(script: str, args: list[str], cwd: str | None = None) -> Inferred:
    """The reference command line of `script` run with `args` (module docstring); UsageError
    with the command line to try when it cannot be inferred."""
    cwd = cwd or os.getcwd()
    path = Path(cwd, script)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError) as exc:
        raise UsageError(f"{script}: cannot read the script to infer the reference "
                         f"({type(exc).__name__}: {exc}); give --reference-args") from exc
    all_flags = init_script.flags(tree, undefaulted=True)
    k = _pick(all_flags, K_FLAGS)
    batch = _pick(all_flags, BATCH_FLAGS)
    if builds_deepspeed_engine(tree):
        # the engine steps at its config's boundary, whatever option fed the config
        return Inferred(args=list(args),
                        text="the DeepSpeed config with gradient_accumulation_steps 1 and "
                        f"{DEEPSPEED_BATCH} K x b (inferred once K is seen)",
                        how="the DeepSpeed config sets K (gradient_accumulation_steps) and the "
                        f"micro-batch ({DEEPSPEED_BATCH}); the reference's engine gets 1 and "
                        "K x b, fp32, ZeRO stage 0, no clipping (the user's config is not "
                        "changed)", K=0, micro_batch=0, k_option="gradient_accumulation_steps",
                        batch_option=DEEPSPEED_BATCH, deferred=True)
    total = _pick(all_flags, TOTAL_FLAGS) if k is None else None
    if total is not None and batch is not None:
        return Inferred(args=list(args), text=f"{batch.option} K x b (inferred once K is seen)",
                        how=f"{total.option} sets K, {batch.option} the micro-batch",
                        K=0, micro_batch=0, k_option=total.option, batch_option=batch.option,
                        deferred=True)
    if k is None or batch is None:
        from_config = (_from_configs(script, args, cwd, k, batch, all_flags)
                       or _from_literals(script, args, tree, k, batch, all_flags))
        if from_config is not None:
            return from_config
        missing = " and ".join(w for w, f in (("the gradient accumulation steps (K)", k),
                                               ("the micro-batch size", batch)) if f is None)
        derived = (f". A script that derives K itself from its batch option (YOLOv5's "
                   f"`accumulate = round(nbs / batch_size)`) takes {batch.option} alone at "
                   "K x the micro-batch" if k is None and batch is not None else "")
        raise UsageError(
            f"cannot infer the reference of {script}: no option for {missing} was found among "
            "its argparse options, module-level configuration or the YAML/JSON config files "
            "among its arguments. Give the reference's arguments (K = 1, the batch K times the "
            "micro-batch), e.g.: " + _to_try(script, args, k, batch, None, None) + derived)
    configs = _config_files(args, cwd) if k.configurator else []
    longs = _long_options(all_flags)
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    givens: dict[str, _Given] = {}
    try:
        for role, flag in (("K", k), ("batch", batch)):
            values[role], sources[role], givens[role] = _read(flag, args, longs, configs)
    except ValueError as exc:
        raise UsageError(
            f"cannot infer the reference of {script}: {exc}. Give the reference's arguments "
            "(K = 1, the batch K times the micro-batch), e.g.: "
            + _to_try(script, args, k, batch, values.get("K"), values.get("batch"))) from None
    K, b = values["K"], values["batch"]
    ref = _set(_set(args, k, givens["K"], 1), batch, givens["batch"], K * b)
    how = (f"{k.option} {K} ({sources['K']}) -> 1, {batch.option} {b} ({sources['batch']}) "
           f"-> {K * b}")
    return Inferred(args=ref, text=f"{shlex.join(ref)} (inferred)", how=how, K=K,
                    micro_batch=b, k_option=k.option, batch_option=batch.option,
                    sources=sources)


def _read(flag: Flag, args: list[str], longs: list[str],
          configs: list[tuple[str, list[Flag]]]) -> tuple[int, str, _Given]:
    """The value `flag` has in this command line, where it came from ("args", "default",
    "config FILE"), and where ARGS set it; ValueError when it has none or not a count."""
    given = _occurrences(flag, args, longs)
    text: Any = flag.default
    source = "default"
    for name, settings in configs:
        for setting in settings:
            if setting.name in flag.names:
                text, source = setting.default, f"config {name}"
    if given.value is not None:
        text, source = given.value, "args"
    if text is None:
        raise ValueError(f"{flag.option} has no default and is not in the script's arguments")
    return _number(text, flag.option), source, given


def _from_configs(script: str, args: list[str], cwd: str, k: Flag | None, batch: Flag | None,
                  all_flags: list[Flag]) -> Inferred | None:
    """K and/or the micro-batch read from a YAML/JSON config file among ARGS, the reference
    pointed at a copy with K = 1 and K x b (`infer_config`); None when the config files do
    not hold what the options lack; UsageError when a key is ambiguous or not a count."""
    from .infer_config import ConfigSetting, config_files, find, reference_copy
    files = config_files(args, cwd)
    if not files:
        return None
    k_at = find(files, K_FLAGS) if k is None else None
    near = k_at if isinstance(k_at, ConfigSetting) else None
    b_at = find(files, BATCH_FLAGS, near) if batch is None else None
    for what, at in (("K (the gradient accumulation steps)", k_at),
                     ("the micro-batch size", b_at)):
        if isinstance(at, list):
            raise UsageError(f"cannot infer the reference of {script}: {what} is set in several "
                             f"places of its config ({'; '.join(at)}). Give the reference's "
                             "arguments: a copy of the config with K = 1 and the batch K times "
                             f"the micro-batch, e.g. ampdoctor diagnose {script} "
                             "--reference-args '... REFERENCE-CONFIG ...' -- "
                             + (shlex.join(args) if args else "ARGS"))
    if (k is None and k_at is None) or (batch is None and b_at is None):
        return None
    longs = _long_options(all_flags)
    ref, parts, sources = list(args), [], {}
    values: dict[str, int] = {}
    changes: list[tuple[ConfigSetting, int]] = []
    names: dict[str, str] = {}
    for role, flag, at in (("K", k, k_at), ("batch", batch, b_at)):
        if flag is not None:
            try:
                values[role], sources[role], given = _read(flag, args, longs, [])
            except ValueError as exc:
                raise UsageError(f"cannot infer the reference of {script}: {exc}; give "
                                 "--reference-args") from None
            names[role] = flag.option
        else:
            assert isinstance(at, ConfigSetting)
            if at.value < 1:
                raise UsageError(f"cannot infer the reference of {script}: {at.shown} in "
                                 f"{at.text} is {at.value}, not a positive whole number")
            values[role], sources[role] = at.value, f"config {at.text}"
            names[role] = at.shown
    K, b = values["K"], values["batch"]
    for role, flag, at, value in (("K", k, k_at, 1), ("batch", batch, b_at, K * b)):
        if flag is not None:
            ref = _set(ref, flag, _occurrences(flag, args, longs), value)
        else:
            assert isinstance(at, ConfigSetting)
            changes.append((at, value))
        parts.append(f"{names[role]} {values[role]} ({sources[role]}) -> {value}")
    ref = reference_copy(ref, files, changes)
    copied = sorted({a.text for a, _ in changes})
    how = ", ".join(parts) + f"; the reference reads a copy of {', '.join(copied)}"
    return Inferred(args=ref, text=f"{shlex.join(ref)} (inferred)", how=how, K=K,
                    micro_batch=b, k_option=names["K"], batch_option=names["batch"],
                    sources=sources)


def _from_literals(script: str, args: list[str], tree: ast.Module, k: Flag | None,
                   batch: Flag | None, all_flags: list[Flag]) -> Inferred | None:
    """K and/or the micro-batch written in the script as literals (`constants`): the reference
    runs the script with them changed; None when it writes neither that the options lack;
    UsageError when one is written in several places."""
    from .constants import Literal, literals, pick
    found = literals(tree)
    k_at = pick(found, K_FLAGS) if k is None else None
    b_at = pick(found, BATCH_FLAGS) if batch is None else None
    name = os.path.basename(script)
    for what, at in (("K (the gradient accumulation steps)", k_at),
                     ("the micro-batch size", b_at)):
        if isinstance(at, list):
            places = "; ".join(f"{a.name} = {a.value} at line {a.line}" for a in at)
            raise UsageError(f"cannot infer the reference of {script}: {what} is written in "
                             f"several places of the script ({places}): which one the run uses "
                             "is not known. Make it one option or one constant, or give "
                             "--reference-args")
    if (k is None and k_at is None) or (batch is None and b_at is None):
        return None
    longs = _long_options(all_flags)
    values: dict[str, int] = {}
    shown: dict[str, str] = {}
    sources = {"K": "script", "batch": "script"}
    for role, flag, at in (("K", k, k_at), ("batch", batch, b_at)):
        if flag is not None:
            try:
                values[role], source, _ = _read(flag, args, longs, [])
                sources[role] = source
            except ValueError as exc:
                raise UsageError(f"cannot infer the reference of {script}: {exc}; give "
                                 "--reference-args") from None
            shown[role] = f"{flag.option} {values[role]} ({source})"
        else:
            assert isinstance(at, Literal)
            if at.value < 1:
                raise UsageError(f"cannot infer the reference of {script}: {at.name} = "
                                 f"{at.value} at {name}:{at.line} is not a positive count")
            values[role] = at.value
            shown[role] = f"{at.name} = {at.value} ({name}:{at.line})"
    K, b = values["K"], values["batch"]
    ref: list[str] = list(args)
    rewrites: list[tuple[str, str, int, int, int]] = []
    parts: list[str] = []
    for role, flag, at, value in (("K", k, k_at, 1), ("batch", batch, b_at, K * b)):
        if flag is not None:
            ref = _set(ref, flag, _occurrences(flag, args, longs), value)
        else:
            assert isinstance(at, Literal)
            rewrites.append((role, at.name, at.line, at.col, value))
        parts.append(f"{shown[role]} -> {value}")
    literal = [a.name for a in (k_at, b_at) if isinstance(a, Literal)]
    how = (", ".join(parts) + f"; the reference's runs set {' and '.join(literal)} in "
           "the script's code as it runs (your file is not changed)")
    text = (shlex.join(ref) + " " if ref else "") + " ".join(
        f"{a.name}={v}" for a, v in ((k_at, 1), (b_at, K * b)) if isinstance(a, Literal))
    return Inferred(args=ref, text=f"{text} (inferred)", how=how, K=K, micro_batch=b,
                    k_option=k.option if k is not None else str(getattr(k_at, "name", "")),
                    batch_option=(batch.option if batch is not None
                                  else str(getattr(b_at, "name", ""))),
                    sources=sources, rewrites=rewrites)


def _pick(all_flags: list[Flag], names: tuple[str, ...]) -> Flag | None:
    """The first option (in the order of `names`) that sets K / the batch, with or without a
    default."""
    for wanted in names:
        for flag in all_flags:
            if wanted in flag.names and (flag.default is None
                                         or isinstance(flag.default, (int, float))):
                return flag
    return None


def deepspeed_options(script: str, args: list[str], K: set[int], b: int, batch: int,
                      cwd: str | None = None) -> list[str]:
    """A DeepSpeed script's reference arguments: `args` with its own accumulation option set to
    1 and its batch option to `batch` where their values (given or default) are K (the engine
    config's or the loop's) and b -- the options that feed its config or its loop's own
    accumulation, which a script may also divide the loss by."""
    try:
        tree = ast.parse(Path(cwd or os.getcwd(), script).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return list(args)
    all_flags = init_script.flags(tree, undefaulted=True)
    longs = _long_options(all_flags)
    out = list(args)
    for names, engine, value in ((K_FLAGS, K, 1), (BATCH_FLAGS, {b}, batch)):
        flag = _pick(all_flags, names)
        if flag is None or flag.configurator:
            continue
        given = _occurrences(flag, out, longs)
        try:
            current = _number(given.value if given.value is not None else flag.default, "")
        except ValueError:
            continue
        if current in engine:
            out = _set(out, flag, given, value)
    return out


def with_batch(script: str, args: list[str], batch: int, cwd: str | None = None
               ) -> list[str] | None:
    """`args` (a reference's) with the script's batch option set to `batch`: the command line
    of a reference over one micro-batch per step; None when the script has no batch option
    ampdoctor can read."""
    try:
        tree = ast.parse(Path(cwd or os.getcwd(), script).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return None
    all_flags = init_script.flags(tree, undefaulted=True)
    flag = _pick(all_flags, BATCH_FLAGS)
    if flag is None:
        return None
    return _set(args, flag, _occurrences(flag, args, _long_options(all_flags)), batch)
