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
from .argv import Given, long_options, number, occurrences, set_option


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
    longs = long_options(all_flags)
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    givens: dict[str, Given] = {}
    try:
        for role, flag in (("K", k), ("batch", batch)):
            values[role], sources[role], givens[role] = _read(flag, args, longs, configs)
    except ValueError as exc:
        raise UsageError(
            f"cannot infer the reference of {script}: {exc}. Give the reference's arguments "
            "(K = 1, the batch K times the micro-batch), e.g.: "
            + _to_try(script, args, k, batch, values.get("K"), values.get("batch"))) from None
    K, b = values["K"], values["batch"]
    ref = set_option(set_option(args, k, givens["K"], 1), batch, givens["batch"], K * b)
    how = (f"{k.option} {K} ({sources['K']}) -> 1, {batch.option} {b} ({sources['batch']}) "
           f"-> {K * b}")
    return Inferred(args=ref, text=f"{shlex.join(ref)} (inferred)", how=how, K=K,
                    micro_batch=b, k_option=k.option, batch_option=batch.option,
                    sources=sources)


def _read(flag: Flag, args: list[str], longs: list[str],
          configs: list[tuple[str, list[Flag]]]) -> tuple[int, str, Given]:
    """The value `flag` has in this command line, where it came from ("args", "default",
    "config FILE"), and where ARGS set it; ValueError when it has none or not a count."""
    given = occurrences(flag, args, longs)
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
    return number(text, flag.option), source, given


@dataclass(frozen=True)
class _Elsewhere:
    """K or the micro-batch read outside the options: a config file's key, a literal written
    in the script (`what`: its `ConfigSetting` / `constants.Literal`)."""

    value: int
    label: str       # "train.batch_size", "BATCH_SIZE"
    source: str      # "config cfg.yaml", "script"
    shown: str       # "train.batch_size 8 (config cfg.yaml)", "BATCH_SIZE = 8 (train.py:19)"
    what: Any


def _combine(script: str, args: list[str], all_flags: list[Flag], k: Flag | None,
             batch: Flag | None, elsewhere: dict[str, _Elsewhere]
             ) -> tuple[int, int, list[str], list[str], dict[str, str], dict[str, str],
                        list[tuple[str, _Elsewhere, int]]]:
    """K and the micro-batch from the options there are (`k`, `batch`) and from `elsewhere`
    for the role ("K", "batch") an option lacks: (K, b, the reference's ARGS with the options
    set to 1 and K x b, each role's "what -> new value", sources, names, and the changes left
    to make outside ARGS as (role, where, new value))."""
    longs = long_options(all_flags)
    values: dict[str, int] = {}
    shown: dict[str, str] = {}
    sources: dict[str, str] = {}
    names: dict[str, str] = {}
    for role, flag in (("K", k), ("batch", batch)):
        if flag is not None:
            try:
                values[role], sources[role], _ = _read(flag, args, longs, [])
            except ValueError as exc:
                raise UsageError(f"cannot infer the reference of {script}: {exc}; give "
                                 "--reference-args") from None
            names[role] = flag.option
            shown[role] = f"{flag.option} {values[role]} ({sources[role]})"
        else:
            at = elsewhere[role]
            values[role], sources[role], names[role], shown[role] = (at.value, at.source,
                                                                     at.label, at.shown)
    K, b = values["K"], values["batch"]
    ref, parts = list(args), []
    changes: list[tuple[str, _Elsewhere, int]] = []
    for role, flag, value in (("K", k, 1), ("batch", batch, K * b)):
        if flag is not None:
            ref = set_option(ref, flag, occurrences(flag, args, longs), value)
        else:
            changes.append((role, elsewhere[role], value))
        parts.append(f"{shown[role]} -> {value}")
    return K, b, ref, parts, sources, names, changes


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
    elsewhere: dict[str, _Elsewhere] = {}
    for role, at in (("K", k_at), ("batch", b_at)):
        if isinstance(at, ConfigSetting):
            if at.value < 1:
                raise UsageError(f"cannot infer the reference of {script}: {at.shown} in "
                                 f"{at.text} is {at.value}, not a positive whole number")
            source = f"config {at.text}"
            elsewhere[role] = _Elsewhere(at.value, at.shown, source,
                                         f"{at.shown} {at.value} ({source})", at)
    K, b, ref, parts, sources, names, changes = _combine(script, args, all_flags, k, batch,
                                                         elsewhere)
    ref = reference_copy(ref, files, [(at.what, value) for _, at, value in changes])
    copied = sorted({at.what.text for _, at, _ in changes})
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
    elsewhere: dict[str, _Elsewhere] = {}
    for role, at in (("K", k_at), ("batch", b_at)):
        if isinstance(at, Literal):
            if at.value < 1:
                raise UsageError(f"cannot infer the reference of {script}: {at.name} = "
                                 f"{at.value} at {name}:{at.line} is not a positive count")
            elsewhere[role] = _Elsewhere(at.value, at.name, "script",
                                         f"{at.name} = {at.value} ({name}:{at.line})", at)
    K, b, ref, parts, sources, names, changes = _combine(script, args, all_flags, k, batch,
                                                         elsewhere)
    rewrites = [(role, at.what.name, at.what.line, at.what.col, value)
                for role, at, value in changes]
    how = (", ".join(parts) + f"; the reference's runs set "
           f"{' and '.join(at.label for _, at, _ in changes)} in the script's code as it runs "
           "(your file is not changed)")
    text = (shlex.join(ref) + " " if ref else "") + " ".join(
        f"{at.label}={value}" for _, at, value in changes)
    return Inferred(args=ref, text=f"{text} (inferred)", how=how, K=K, micro_batch=b,
                    k_option=names["K"], batch_option=names["batch"], sources=sources,
                    rewrites=rewrites)


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
    longs = long_options(all_flags)
    out = list(args)
    for names, engine, value in ((K_FLAGS, K, 1), (BATCH_FLAGS, {b}, batch)):
        flag = _pick(all_flags, names)
        if flag is None or flag.configurator:
            continue
        given = occurrences(flag, out, longs)
        try:
            current = number(given.value if given.value is not None else flag.default, "")
        except ValueError:
            continue
        if current in engine:
            out = set_option(out, flag, given, value)
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
    return set_option(args, flag, occurrences(flag, args, long_options(all_flags)), batch)
