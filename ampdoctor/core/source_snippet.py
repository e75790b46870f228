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


def _read_lines(file: str) -> list[str] | None:
    """The lines of `file` when it is a regular file of at most MAX_FILE_BYTES; None otherwise.
    Never blocks: a FIFO or a device is refused before opening, and the descriptor is opened
    non-blocking and checked again (a file swapped for a FIFO in between)."""
    import os
    import stat

    try:
        info = os.stat(file)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
            return None
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
                return None
            chunks, left = [], MAX_FILE_BYTES + 1
            while left > 0 and (chunk := os.read(fd, left)):
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
        finally:
            os.close(fd)
    except (OSError, ValueError):      # ValueError: a NUL in a hand-made path
        return None
    if len(data) > MAX_FILE_BYTES:
        return None
    return data.decode("utf-8", errors="replace").splitlines()


def snippet(file: str, line: int, context: int = CONTEXT) -> dict[str, Any] | None:
    """{"file", "start", "line", "lines"} around `line` of `file`; None when unreadable.
    The lines are kept as they are (a record is data); the renderings make them inert."""
    text = _read_lines(file)
    if text is None:
        return None
    if not 1 <= line <= len(text):
        return None
    start = max(1, line - context)
    end = min(len(text), line + context)
    lines = [t if len(t) <= MAX_LINE else t[:MAX_LINE - 1] + "…" for t in text[start - 1:end]]
    return {"file": file, "start": start, "line": line, "lines": lines}

