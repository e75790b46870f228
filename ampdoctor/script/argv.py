"""The script's ARGS as its argparse parser reads them: where an option is set (`occurrences`,
every form argparse accepts), ARGS with it set to another value (`set_option`), and ARGS the
parser would refuse, told before anything runs (exit 2: a long option given as a prefix of
several of its options, or any prefix under `allow_abbrev=False`)."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..init import script as init_script
from ..init.script import Flag


def check_args(script: str, args: list[str], cwd: str | None = None) -> None:
    """UsageError (exit 2) when the script's own argparse parser would reject ARGS for a long
    option given as a prefix: one that several of its long options start with (argparse:
    "ambiguous option"), or any prefix when the parser sets `allow_abbrev=False` ("unrecognized
    arguments"). Both the run and the reference would exit 2 at `parse_args`, and the cause is
    the user's arguments, not the reference's. A script ampdoctor cannot read, or whose options
    come from elsewhere (HfArgumentParser), is left to its own parser."""
    try:
        source = Path(cwd or os.getcwd(), script).read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return
    if "HfArgumentParser" in source:
        return
    parsers = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
               and getattr(n.func, "attr", getattr(n.func, "id", None)) == "ArgumentParser"]
    if not parsers:
        return
    abbrev = not any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant)
                     and k.value.value is False for p in parsers for k in p.keywords)
    longs = sorted(set([o for f in init_script.flags(tree, undefaulted=True) for o in f.options
                    if o.startswith("--")]))
    for arg in args:
        if arg == "--":
            break
        key = arg.split("=", 1)[0]
        if not key.startswith("--") or key == "--" or key in longs:
            continue
        matches = [o for o in longs if o.startswith(key)]
        if not matches or (abbrev and len(matches) == 1):
            continue
        said = (f"ambiguous option: {arg} could match {', '.join(matches)}" if abbrev
                else f"unrecognized arguments: {arg} (its parser sets allow_abbrev=False, so "
                f"{matches[0]} must be written in full)")
        raise UsageError(
            f"the script's arguments: {key} is not one of {os.path.basename(script)}'s "
            f"options but a prefix of {' and '.join(matches)}, and its argparse parser would "
            f"stop at it ({said}): the run and the reference would both exit 2 before "
            f"training. Write the option in full, e.g. {matches[0]}")


@dataclass
class Given:
    """Where an option is set in ARGS: (index, form) per occurrence, the last value."""

    at: list[tuple[int, str, str]] = field(default_factory=list)   # (index, form, option)
    value: str | None = None


def long_options(all_flags: list[Flag]) -> list[str]:
    return [o for f in all_flags for o in f.options if o.startswith("--")]


def occurrences(flag: Flag, args: list[str], longs: list[str]) -> Given:
    """Every place ARGS sets `flag`, as argparse reads them (the last one wins)."""
    given = Given()
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


def number(text: Any, what: str) -> int:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what} is {text!r}, not a number") from None
    if value != int(value) or value < 1:
        raise ValueError(f"{what} is {text!r}, not a positive whole number")
    return int(value)


def set_option(args: list[str], flag: Flag, given: Given, value: int) -> list[str]:
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
