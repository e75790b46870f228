"""ARGS that the script's own argparse parser would refuse, told before anything runs (exit 2):
a long option given as a prefix of several of its options, or any prefix under
`allow_abbrev=False`."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from ..core.errors import UsageError
from ..init import script as init_script


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
