"""The terminal rendering of a run record: a table of rungs, then each finding with its
evidence, the user's file:line and the fix.

Every value from the record is the user's world (a spec name, a path, an exception message, a
hand-edited record): it is shown as rich `Text` (never parsed as markup) and through
`safetext.inert` (no ESC, OSC, C1, CR or bidi override reaches the terminal raw), cut to a
bound with a note (`FIELD_LIMIT` for one-line fields, `MESSAGE_LIMIT` for messages).
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..safetext import FIELD_LIMIT, MESSAGE_LIMIT, inert


def _one(value: Any, limit: int = FIELD_LIMIT) -> str:
    """A one-line field of the record, safe to print."""
    return inert("" if value is None else value, limit=limit, multiline=False)


def _many(value: Any, limit: int = MESSAGE_LIMIT) -> str:
    """A message of the record (newlines and tabs kept), safe to print."""
    return inert("" if value is None else value, limit=limit, multiline=True)

STATUS_STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim",
                "not-run": "dim"}
VERDICT_STYLE = {"healthy": "bold green", "failed": "bold red", "error": "bold magenta",
                 "inconclusive": "bold yellow"}


def display_path(path: Any) -> str:
    """`path` relative to the working directory when that is shorter to read (as it is, not
    made inert: the callers that print it do that)."""
    path = "" if path is None else str(path)
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith(".." + os.sep + "..") else path


def _where(loc: Any) -> str:
    """`file:line` of a record's location, safe to print."""
    if not isinstance(loc, dict):
        return _one(loc)
    return f"{_one(display_path(loc.get('file')))}:{_one(loc.get('line'))}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        more = ", ..." if len(value) > 8 else ""
        return "[" + ", ".join(_fmt(v) for v in value[:8]) + more + "]"
    return _one(value)


def _seconds(value: Any) -> str:
    try:
        return f"{float(value or 0):.2f}s"
    except (TypeError, ValueError):
        return _one(value)


def render(record: dict[str, Any], console: Console) -> None:
    verdict = record.get("verdict", "error")
    head = Text()
    head.append("ampdoctor ", style="bold")
    head.append(f"{_one(record.get('name', ''))}  ")
    head.append(_one(verdict).upper(),
                style=VERDICT_STYLE.get(verdict, "bold") if isinstance(verdict, str) else "bold")
    device = record.get("device", "unknown")
    head.append(f"   device: {_one(device)}")
    if device == "cpu":
        head.append(" (no CUDA: every rung ran on the CPU)", style="dim")
    console.print(head)
    ran = what_ran(record)
    if ran:
        console.print(Text(ran, style="dim"))
    found = record.get("found")
    if isinstance(found, dict) and isinstance(found.get("text"), str):
        console.print(Text(_many(found["text"]), style="dim"))

    if record.get("error") and not record.get("rungs"):
        err = record["error"]
        loc = err.get("location")
        where = f"\n  at {_where(loc)}" if loc else ""
        text = Text.assemble(("error: ", "bold magenta"), f"{_many(err.get('message'))}{where}")
        if (err.get("source") or {}).get("lines"):
            text.append("\n")
            _source_lines(text, err["source"])
        console.print(text)
        return

    table = Table(show_header=True, header_style="bold", expand=False)
    table.add_column("rung", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    # the summary wraps between words, never inside one: its column is at least as wide as
    # its longest word (a path, a number), so rich never has to fold one
    table.add_column("summary", overflow="fold", min_width=_longest_word(
        _many(rung.get("summary", "")) for rung in record.get("rungs", [])))
    for rung in record.get("rungs", []):
        status = rung.get("status", "")
        # every value from the record is text, never rich markup ("[/]" in a message)
        table.add_row(Text(_one(rung.get("id", ""))),
                      Text(_one(status), style=STATUS_STYLE.get(status, "")
                           if isinstance(status, str) else ""),
                      _seconds(rung.get("seconds", 0)),
                      Text(_many(rung.get("summary", ""))))
    console.print(table)

    for finding in record.get("findings", []):
        console.print(_finding_panel(finding))
    for note in record.get("notes", []):
        console.print(Text(f"note: {_many(note)}", style="dim"))
    if verdict == "healthy" and not record.get("findings"):
        console.print("[green]No finding: accumulation and mixed precision match the fp32 "
                      "reference on every rung that ran.[/]")
    elif verdict == "inconclusive":
        console.print(Text(f"Inconclusive: {_many(record.get('inconclusive') or '')}",
                           style="yellow"))


def what_ran(record: dict[str, Any]) -> str:
    """A script's record: the command line that ran and the reference's (given or inferred);
    '' for a spec's (its name is the spec's)."""
    script = record.get("script")
    if not isinstance(script, str):
        return ""
    args = record.get("args")
    line = f"script: {_one(' '.join([script, *map(str, args if isinstance(args, list) else [])]))}"
    reference = record.get("reference_args")
    if isinstance(reference, list):
        origin = record.get("reference_args_origin") or "given"
        line += f" · reference: {_one(' '.join(map(str, reference)))} ({_one(origin)})"
    else:
        line += " · no reference"
    return line


def _longest_word(texts: Any) -> int:
    """The longest run of non-space characters (at most LONGEST_WORD): a column this wide
    never folds a path or a number."""
    return min(LONGEST_WORD, max((len(word) for text in texts for word in str(text).split()),
                                 default=1))


#: a word longer than this (a pasted blob) may still be folded
LONGEST_WORD = 60


def _finding_panel(finding: dict[str, Any]) -> Panel:
    severity = finding.get("severity", "error")
    style = "red" if severity == "error" else "yellow"
    body = Text()
    body.append(_many(finding.get("message", "")) + "\n")
    loc = finding.get("location")
    if loc:
        body.append("\n  at ", style="dim")
        body.append(_where(loc), style="bold")
        source = finding.get("source") or {}
        if isinstance(source, dict) and source.get("lines"):
            body.append("\n")
            _source_lines(body, source)
        elif isinstance(loc, dict) and loc.get("code"):
            body.append(f"    {_one(loc['code'])}", style="cyan")
        body.append("\n")
    evidence = finding.get("evidence") or {}
    if isinstance(evidence, dict) and evidence:
        body.append("\n  evidence: ", style="dim")
        keys = ["measured", "expected", "tolerance"] + [k for k in evidence if k not in
                                                        ("measured", "expected", "tolerance")]
        body.append(", ".join(f"{_one(k)}={_fmt(evidence[k])}" for k in keys if k in evidence))
        body.append("\n")
    if finding.get("fix"):
        body.append("\n  fix: ", style="bold green")
        body.append(_many(finding["fix"]))
    title = Text(f"{_one(severity)}: {_one(finding.get('kind'))} [{_one(finding.get('rung'))}] "
                 f"{_one(finding.get('title', ''))}")
    return Panel(body, title=title, title_align="left", border_style=style, expand=False)


def error_text(message: str, location: tuple[str, int] | None = None) -> str:
    """An error's message and where, safe to print (as text: not rich markup)."""
    where = (f"\n  at {_one(display_path(location[0]))}:{_one(location[1])}"
             if location else "")
    return f"{_many(message)}{where}"


def _source_lines(body: Text, source: dict[str, Any]) -> None:
    """The user's lines around the finding, the offending one marked (text, never markup)."""
    try:
        start, hit = int(source.get("start") or 1), int(source.get("line") or 0)
    except (TypeError, ValueError):     # a hand-edited record
        start, hit = 1, 0
    lines = source.get("lines") or []
    if not isinstance(lines, list):
        lines = [lines]
    for offset, line in enumerate(lines):
        number = start + offset
        mark = ">" if number == hit else " "
        body.append(f"  {mark}{number:5d} | ", style="dim")
        # tabs stay (indentation); any other control is shown
        body.append(_many(line, FIELD_LIMIT) + ("\n" if offset < len(lines) - 1 else ""),
                    style="bold cyan" if number == hit else "")
