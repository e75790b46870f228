"""`ampdoctor explain [KIND]`: what a diagnosis kind is, why it matters, how to fix it."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console

from ..core.errors import UsageError
from .common import fail
from .completion import complete_kind


def explain(
    kind: str | None = typer.Argument(None, help="A diagnosis kind, e.g. clip-before-unscale "
                                      "(none: list every kind).",
                                      autocompletion=complete_kind),
    json_out: bool = typer.Option(False, "--json", help="Print the explanation as JSON."),
    list_all: bool = typer.Option(False, "--list", help="List every kind (with --json: every "
                                  "kind's full entry, `decided_in` included)."),
) -> None:
    """Explain a diagnosis kind: what it is, why it matters, how to fix it."""
    from rich.text import Text

    known = explanations()
    console = Console()
    if list_all and kind is not None:
        raise typer.Exit(fail(UsageError(f"--list lists every kind: give it no KIND (got "
                                         f"{kind!r})"), False))
    if list_all and json_out:
        sys.stdout.write(json.dumps(list(known.values()), indent=2) + "\n")
        return
    if kind is None:
        if json_out:
            sys.stdout.write(json.dumps({k: e["title"] for k, e in known.items()}, indent=2)
                             + "\n")
            return
        for name, entry in known.items():
            console.print(Text.assemble((f"{name:32}", "bold"), entry["title"]))
        return
    found = known.get(kind)
    if found is None:
        import difflib
        close = difflib.get_close_matches(kind, list(known), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise typer.Exit(fail(UsageError(f"unknown kind {kind!r}.{hint} Kinds: "
                                         f"{', '.join(known)}"), False))
    if json_out:
        sys.stdout.write(json.dumps(found, indent=2) + "\n")
        return
    # headings are ampdoctor's markup; the texts are printed literally
    sections = [(f"{found['kind']}", found["title"]), ("Why is this bad?", found["why"]),
                ("Example", found["example"]), ("Fix", found["fix"])]
    sections += [("Measured", found["measured"]), ("Decided in", found["decided_in"])]
    for heading, body in sections:
        if body:
            console.print(Text(heading, style="bold"))
            console.print(Text(body + "\n"))


def explanations() -> dict[str, dict[str, Any]]:
    """Every diagnosis kind, in the catalogue's order, as `explain KIND --json` prints it: the
    catalogue's texts, what its `evidence.measured` counts and its one decider (`decided_in`,
    an importable `module:function`). The one place the command reads the kind registry
    (`findings`)."""
    from ..kinds import CATALOGUE, RULES
    known: dict[str, dict[str, Any]] = {}
    for name, entry in CATALOGUE.items():
        rule = RULES[name]
        known[name] = {"kind": entry.name, "title": entry.title, "why": entry.why,
                       "example": entry.example, "fix": entry.fix,
                       "measured": rule.measured, "decided_in": rule.decided_in}
    return known
