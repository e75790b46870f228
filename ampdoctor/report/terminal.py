"""The terminal rendering of a run record: a table of rungs, then each finding with its
evidence, the user's file:line and the fix.

Every value from the record is the user's world (a spec name, a path, an exception message, a
hand-edited record): it is shown as rich `Text` (never parsed as markup) and through
`safetext.inert` (no ESC, OSC, C1, CR or bidi override reaches the terminal raw), cut to a
bound with a note (`FIELD_LIMIT` for one-line fields, `MESSAGE_LIMIT` for messages).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..core.safetext import FIELD_LIMIT, MESSAGE_LIMIT, inert

if TYPE_CHECKING:
    from ..record.model import FindingModel, LocationModel, RecordModel, SourceModel


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


def _where(loc: LocationModel) -> str:
    """`file:line` of a record's location, safe to print."""
    return f"{_one(display_path(loc.file))}:{_one(loc.line)}"


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


def render(record: RecordModel | Mapping[str, Any], console: Console) -> None:
    """The record on `console` (a record's JSON data is read as one: `record.as_record`)."""
    from ..record import as_record
    record = as_record(record)
    verdict = record.verdict
    head = Text()
    head.append("ampdoctor ", style="bold")
    head.append(f"{_one(record.name)}  ")
    head.append(_one(verdict).upper(), style=VERDICT_STYLE.get(verdict, "bold"))
    device = record.device
    head.append(f"   device: {_one(device)}")
    if device == "cpu":
        head.append(" (no CUDA: every rung ran on the CPU)", style="dim")
    console.print(head)
    ran = what_ran(record)
    if ran:
        console.print(Text(ran, style="dim"))
    found = record.found
    if found is not None and isinstance(found.get("text"), str):
        console.print(Text(_many(found["text"]), style="dim"))

    err = record.error
    if err is not None and not record.rungs:
        where = f"\n  at {_where(err.location)}" if err.location else ""
        text = Text.assemble(("error: ", "bold magenta"), f"{_many(err.message)}{where}")
        if err.source is not None and err.source.lines:
            text.append("\n")
            _source_lines(text, err.source)
        console.print(text)
        return

    table = Table(show_header=True, header_style="bold", expand=False)
    table.add_column("rung", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    # the summary wraps between words, never inside one: its column is at least as wide as
    # its longest word (a path, a number), so rich never has to fold one
    table.add_column("summary", overflow="fold", min_width=_longest_word(
        _many(rung.summary) for rung in record.rungs))
    for rung in record.rungs:
        # every value from the record is text, never rich markup ("[/]" in a message)
        table.add_row(Text(_one(rung.id)),
                      Text(_one(rung.status), style=STATUS_STYLE.get(rung.status, "")),
                      _seconds(rung.seconds),
                      Text(_many(rung.summary)))
    console.print(table)

    for finding in record.findings:
        console.print(_finding_panel(finding))
    for note in record.notes:
        console.print(Text(f"note: {_many(note)}", style="dim"))
    if verdict == "healthy" and not record.findings:
        console.print("[green]No finding: accumulation and mixed precision match the fp32 "
                      "reference on every rung that ran.[/]")
    elif verdict == "inconclusive":
        console.print(Text(f"Inconclusive: {_many(record.inconclusive or '')}",
                           style="yellow"))


def what_ran(record: RecordModel) -> str:
    """A script's record: the command line that ran and the reference's (given or inferred);
    '' for a spec's (its name is the spec's)."""
    script = record.script
    if script is None:
        return ""
    line = f"script: {_one(' '.join([script, *(record.args or [])]))}"
    reference = record.reference_args
    if reference is not None:
        origin = record.reference_args_origin or "given"
        shown = " ".join(map(str, reference))
        literals = record.reference_literals or []
        if literals:
            shown = (shown + " with " if shown else "") + " ".join(
                f"{item.get('name')}={item.get('value')}" for item in literals
                if isinstance(item, dict)) + " in the script"
        line += f" · reference: {_one(shown)} ({_one(origin)})"
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


def _finding_panel(finding: FindingModel) -> Panel:
    severity = finding.severity
    style = "red" if severity == "error" else "yellow"
    body = Text()
    body.append(_many(finding.message) + "\n")
    loc = finding.location
    if loc:
        body.append("\n  at ", style="dim")
        body.append(_where(loc), style="bold")
        source = finding.source
        if source is not None and source.lines:
            body.append("\n")
            _source_lines(body, source)
        elif loc.code:
            body.append(f"    {_one(loc.code)}", style="cyan")
        body.append("\n")
    evidence = finding.evidence
    if evidence:
        body.append("\n  evidence: ", style="dim")
        keys = ["measured", "expected", "tolerance"] + [k for k in evidence if k not in
                                                        ("measured", "expected", "tolerance")]
        body.append(", ".join(f"{_one(k)}={_fmt(evidence[k])}" for k in keys if k in evidence))
        body.append("\n")
    if finding.fix:
        body.append("\n  fix: ", style="bold green")
        body.append(_many(finding.fix))
    title = Text(f"{_one(severity)}: {_one(finding.kind)} [{_one(finding.rung)}] "
                 f"{_one(finding.title)}")
    return Panel(body, title=title, title_align="left", border_style=style, expand=False)


def error_text(message: str, location: tuple[str, int] | None = None) -> str:
    """An error's message and where, safe to print (as text: not rich markup)."""
    where = (f"\n  at {_one(display_path(location[0]))}:{_one(location[1])}"
             if location else "")
    return f"{_many(message)}{where}"


def _source_lines(body: Text, source: SourceModel) -> None:
    """The user's lines around the finding, the offending one marked (text, never markup)."""
    start, hit = source.start or 1, source.line or 0
    lines = source.lines
    for offset, line in enumerate(lines):
        number = start + offset
        mark = ">" if number == hit else " "
        body.append(f"  {mark}{number:5d} | ", style="dim")
        # tabs stay (indentation); any other control is shown
        body.append(_many(line, FIELD_LIMIT) + ("\n" if offset < len(lines) - 1 else ""),
                    style="bold cyan" if number == hit else "")
