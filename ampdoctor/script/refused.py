"""A script's first run stopped by transformers or accelerate refusing its HF Trainer over the
DeepSpeed config's precision (`rules.trainer_precision`): not the user's bare error, the
double-scaling rung's (`diagnose` names the two settings, as `ampdoctor scan` does). Or by its
own argparse parser refusing the arguments: a usage error naming whose they are."""

from __future__ import annotations

import re
from typing import Any

from ..core.errors import UsageError, UserCodeError
from ..rules.trainer_precision import Refusal, refusal

#: argparse's last line before it exits 2: "PROG: error: MESSAGE"
ARGPARSE_ERROR = re.compile(r"^(\S+): error: (.+)$", re.MULTILINE)


class PrecisionsRefused(UserCodeError):
    """The script's first run was refused by transformers or accelerate: its Trainer's
    precision and the DeepSpeed config it hands over disagree."""

    def __init__(self, message: str, met: Refusal,
                 location: tuple[str, int] | None = None) -> None:
        super().__init__(message, location=location)
        self.refusal = met


def refused(outcome: Any) -> None:
    """Raise PrecisionsRefused when a run (a child's `Outcome`) stopped on that refusal."""
    error = outcome.error or {}
    text = str(error.get("text") or "")
    met = refusal(text)
    if met is None:
        return
    site = error.get("site")
    raise PrecisionsRefused(
        f"the script stopped before its first optimizer step: {met.meaning()} "
        f"({text.splitlines()[0][:200] if text else ''})", met,
        location=(site.file, site.line) if site is not None else None)


def arguments_refused(outcome: Any, output: str, args: list[str], reference: list[str]) -> None:
    """Raise UsageError (exit 2) when the script exited 2 with argparse's "error:" line in its
    output: its parser refused the command line. The options the message names say whose they
    are: the user's ARGS (run and reference alike would stop there), else the reference's."""
    if outcome.ended != "exit 2":
        return
    found = list(ARGPARSE_ERROR.finditer(output or ""))
    if not found:
        return
    prog, message = found[-1].group(1), found[-1].group(2).strip()
    named = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w.-]*)", message))
    keys = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    theirs = {a.split("=", 1)[0] for a in reference if a.startswith("-")} - keys
    if named & keys or not named & theirs:
        raise UsageError(
            f"the script's arguments ({' '.join(args) or 'none'}) were refused by its own "
            f"argument parser ({prog}: error: {message}): the run and the reference would both "
            "stop there, before training. Fix the arguments after `--`")
    raise UsageError(
        f"the reference's arguments ({' '.join(reference)}) were refused by the script's "
        f"argument parser ({prog}: error: {message}): give or fix --reference-args (your ARGS "
        "with K = 1 and the batch K times the micro-batch)")
