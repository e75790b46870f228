"""The terminal rendering of a run record: a table of rungs, then each finding with its
evidence, the user's file:line and the fix."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

STATUS_STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim",
                "not-run": "dim"}
VERDICT_STYLE = {"healthy": "bold green", "failed": "bold red", "error": "bold magenta"}


def display_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith(".." + os.sep + "..") else path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value[:8]) + (", ..." if len(value) > 8 else "") + "]"
    return str(value)


def render(record: dict[str, Any], console: Console) -> None:
    verdict = record.get("verdict", "error")
    head = Text()
    head.append("ampdoctor ", style="bold")
    head.append(f"{record.get('name', '')}  ")
    head.append(verdict.upper(), style=VERDICT_STYLE.get(verdict, "bold"))
    device = record.get("device", "unknown")
    head.append(f"   device: {device}")
    if device == "cpu":
        head.append(" (no CUDA: every rung ran on the CPU)", style="dim")
    console.print(head)

    if record.get("error") and not record.get("rungs"):
        err = record["error"]
        loc = err.get("location")
        where = f"\n  at {display_path(loc['file'])}:{loc['line']}" if loc else ""
        text = Text.assemble(("error: ", "bold magenta"), f"{err.get('message')}{where}")
        if (err.get("source") or {}).get("lines"):
            text.append("\n")
            _source_lines(text, err["source"])
        console.print(text)
        return

    table = Table(show_header=True, header_style="bold", expand=False)
    table.add_column("rung")
    table.add_column("status")
    table.add_column("time", justify="right")
    table.add_column("summary", overflow="fold")
    for rung in record.get("rungs", []):
        status = rung.get("status", "")
        # every value from the record is text, never rich markup ("[/]" in a message)
        table.add_row(Text(rung.get("id", "")), Text(status, style=STATUS_STYLE.get(status, "")),
                      f"{rung.get('seconds', 0):.2f}s", Text(rung.get("summary", "")))
    console.print(table)

    for finding in record.get("findings", []):
        console.print(_finding_panel(finding))
    for note in record.get("notes", []):
        console.print(Text(f"note: {note}", style="dim"))
    if verdict == "healthy" and not record.get("findings"):
        console.print("[green]No finding: accumulation and mixed precision match the fp32 "
                      "reference on every rung that ran.[/]")


def _finding_panel(finding: dict[str, Any]) -> Panel:
    severity = finding.get("severity", "error")
    style = "red" if severity == "error" else "yellow"
    body = Text()
    body.append(finding.get("message", "") + "\n")
    loc = finding.get("location")
    if loc:
        body.append("\n  at ", style="dim")
        body.append(f"{display_path(loc['file'])}:{loc['line']}", style="bold")
        source = finding.get("source") or {}
        if source.get("lines"):
            body.append("\n")
            _source_lines(body, source)
        elif loc.get("code"):
            body.append(f"    {loc['code']}", style="cyan")
        body.append("\n")
    evidence = finding.get("evidence") or {}
    if evidence:
        body.append("\n  evidence: ", style="dim")
        keys = ["measured", "expected", "tolerance"] + [k for k in evidence if k not in
                                                        ("measured", "expected", "tolerance")]
        body.append(", ".join(f"{k}={_fmt(evidence[k])}" for k in keys if k in evidence))
        body.append("\n")
    if finding.get("fix"):
        body.append("\n  fix: ", style="bold green")
        body.append(finding["fix"])
    title = Text(f"{severity}: {finding.get('kind')} [{finding.get('rung')}] "
                 f"{finding.get('title', '')}")
    return Panel(body, title=title, title_align="left", border_style=style, expand=False)


def error_text(message: str, location: tuple[str, int] | None = None) -> str:
    where = f"\n  at {display_path(location[0])}:{location[1]}" if location else ""
    return f"{message}{where}"


def _source_lines(body: Text, source: dict[str, Any]) -> None:
    """The user's lines around the finding, the offending one marked (text, never markup)."""
    start, hit = int(source.get("start") or 1), int(source.get("line") or 0)
    for offset, line in enumerate(source.get("lines") or []):
        number = start + offset
        mark = ">" if number == hit else " "
        body.append(f"  {mark}{number:5d} | ", style="dim")
        body.append(str(line) + ("\n" if offset < len(source["lines"]) - 1 else ""),
                    style="bold cyan" if number == hit else "")
