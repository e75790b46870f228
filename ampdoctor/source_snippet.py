"""A few lines of the user's source around a finding's line, read when the diagnose runs and
kept in the record: a postmortem read weeks later shows the code as it was, not as it is."""

from __future__ import annotations

from typing import Any

#: lines shown before and after the offending one
CONTEXT = 3
#: a longer line is cut (a minified or generated file must not bloat the record)
MAX_LINE = 200
#: files larger than this are not read for a snippet
MAX_FILE_BYTES = 4 * 2**20


def snippet(file: str, line: int, context: int = CONTEXT) -> dict[str, Any] | None:
    """{"file", "start", "line", "lines"} around `line` of `file`; None when unreadable."""
    try:
        import os
        if not os.path.isfile(file) or os.path.getsize(file) > MAX_FILE_BYTES:
            return None
        with open(file, encoding="utf-8", errors="replace") as fh:
            text = fh.read().splitlines()
    except OSError:
        return None
    if not 1 <= line <= len(text):
        return None
    start = max(1, line - context)
    end = min(len(text), line + context)
    lines = [t if len(t) <= MAX_LINE else t[:MAX_LINE - 1] + "…" for t in text[start - 1:end]]
    return {"file": file, "start": start, "line": line, "lines": lines}


def attach(item: dict[str, Any]) -> None:
    """Give a finding (or an error) with a location its `source` snippet."""
    loc = item.get("location")
    if not isinstance(loc, dict) or item.get("source"):
        return
    try:
        found = snippet(str(loc["file"]), int(loc["line"]))
    except (KeyError, TypeError, ValueError):
        return
    if found is not None:
        item["source"] = found
