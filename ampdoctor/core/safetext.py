"""Text from the user's world, made safe to show: visible, inert, and bounded.

Anything ampdoctor shows that the user (or the user's code, or a file on disk) chose — a spec's
`name`, a file name, an exception message, a record re-rendered by `ampdoctor report`, a scanned
file's path — may hold characters that a terminal or a viewer *acts on* instead of showing: ESC
(CSI colours, OSC 0 window titles, OSC 8 hyperlinks), other C0/C1 controls (CR overwrites the
line, NUL, BEL, the 8-bit CSI U+009B), and bidirectional overrides that show a line reversed.
This module turns each of them into its visible escape, so the reader sees exactly what the
text holds and nothing acts on it:

    inert("a" + ESC + "]0;pwned" + BEL + "b")  ->  a\\x1b]0;pwned\\x07b   (as printed)
    inert("abc" + RLO + "def")                  ->  abc\\u202edef

What is made visible (and how):

- C0 controls U+0000–U+001F, DEL U+007F and C1 controls U+0080–U+009F: `\\xNN` (ESC is the four
  characters `\\x1b`). With `multiline=True` (the default) newline and tab are kept, since a
  message or a traceback legitimately has them, and a CR-LF pair is read as a newline; any other
  CR is shown as `\\r` (a lone CR would overwrite the line). With `multiline=False` newline and
  tab are shown as `\\n` and `\\t` too (a title, a file name, one table cell).
- Bidirectional formatting characters: embeddings and overrides U+202A–U+202E, isolates
  U+2066–U+2069, the marks U+200E, U+200F and U+061C: `\\uNNNN`.
- The line and paragraph separators U+2028/U+2029 (some viewers break lines on them): `\\uNNNN`.
- Lone surrogates (a file name that is not valid UTF-8, decoded with `surrogateescape`): `\\uNNNN`
  — printed raw they would make the output stream raise UnicodeEncodeError.

Everything else passes unchanged: accents, CJK, emoji (with their joiners and variation
selectors), and the backslash itself (a Windows path stays readable; a literal `\\x1b` in the
text therefore looks like an escaped ESC, which is harmless). Rich markup is not this module's
business: hand the result to `rich.text.Text` (never parsed as markup) or `rich.markup.escape`.
`inert` is idempotent: its output holds no character it would change.

Size: `cut(text, limit)` keeps the first `limit` characters and says how many more there were
(`… [19,998,000 more characters cut]`). The limits ampdoctor applies when user text enters a
record are below (`MESSAGE_LIMIT`, `TRACEBACK_LIMIT`); `FIELD_LIMIT` bounds a one-line field
(a name, a path, a table cell) where it is shown.

`safe_str(obj)` is `str(obj)` that cannot raise: an exception whose `__str__` raises or returns
something else than a str becomes `<TypeName: str() raised ValueError>`; `safe_repr` likewise;
`exc_text(exc)` is `TypeName: message`, never raising and cut to `MESSAGE_LIMIT`.

This module imports nothing beyond the standard library (no torch, no rich).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["FIELD_LIMIT", "MESSAGE_LIMIT", "TRACEBACK_LIMIT", "cut", "exc_text", "inert",
           "is_inert", "safe_repr", "safe_str"]

#: An exception message from the user's code, as kept in a record (characters).
MESSAGE_LIMIT = 4_000
#: A formatted traceback, as kept in a record (characters).
TRACEBACK_LIMIT = 64 * 1024
#: A one-line field shown in a report: a name, a path, a rung summary, an evidence value.
FIELD_LIMIT = 1_000

#: Bidirectional formatting characters and line/paragraph separators, shown as `\uNNNN`.
_FORMAT_CHARS = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
#: Every character `inert` changes, newline and tab included (they are kept in multiline mode).
_UNSAFE = re.compile(f"[\x00-\x1f\x7f-\x9f{_FORMAT_CHARS}\ud800-\udfff]")
#: In multiline mode: every unsafe character but newline and tab, and the CR-LF pair.
_UNSAFE_MULTILINE = re.compile(f"\r\n|[\x00-\x08\x0b-\x1f\x7f-\x9f{_FORMAT_CHARS}\ud800-\udfff]")

_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _visible(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _multiline_sub(match: re.Match[str]) -> str:
    text = match.group()
    return "\n" if text == "\r\n" else _visible(text)


def safe_str(obj: Any) -> str:
    """`str(obj)`, never raising: a `__str__` that raises, or returns a non-str, gives
    `<TypeName: str() raised ValueError>` (or `... returned int`)."""
    if type(obj) is str:
        return obj
    try:
        # what str() calls, so that a non-str result is named rather than a TypeError (the
        # class's function, unbound: typed Any, as mypy reads `type(obj).__str__` as bound)
        to_str: Any = type(obj).__str__
        text = to_str(obj)
    except BaseException as exc:  # anything the user's __str__ does
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return f"<{_type_name(obj)}: str() raised {_type_name(exc)}>"
    if not isinstance(text, str):
        return f"<{_type_name(obj)}: str() returned {_type_name(text)}, not a str>"
    # a str subclass (markupsafe.Markup...) becomes a plain str
    return text if type(text) is str else str.__str__(text)


def safe_repr(obj: Any, limit: int | None = FIELD_LIMIT) -> str:
    """`repr(obj)` that cannot raise (`<TypeName: repr() raised ValueError>`), cut to `limit`
    characters (a user's `sys.exit(<huge object>)`)."""
    try:
        text = repr(obj)
    except BaseException as exc:  # anything the user's __repr__ does
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        text = f"<{_type_name(obj)}: repr() raised {_type_name(exc)}>"
    if not isinstance(text, str):  # pragma: no cover - repr() itself refuses a non-str
        text = f"<{_type_name(obj)}>"
    return cut(text, limit) if limit is not None else text


def _type_name(obj: Any) -> str:
    try:
        return type(obj).__name__
    except Exception:  # noqa: BLE001  # pragma: no cover - a metaclass that breaks __name__
        return "object"


def exc_text(exc: BaseException, limit: int | None = MESSAGE_LIMIT) -> str:
    """`TypeName: message` of an exception from the user's code, as ampdoctor quotes it in a
    message or a finding's evidence: never raising (`safe_str`) and cut to `limit` characters
    (default `MESSAGE_LIMIT`; None: whole). Not made inert: a record keeps the text as it was."""
    text = safe_str(exc)
    name = _type_name(exc)
    text = f"{name}: {text}" if text else name
    return cut(text, limit) if limit is not None else text


def cut(text: str, limit: int, *, tail: int = 0) -> str:
    """`text` whole when it has at most `limit` characters; else its first `limit - tail`
    characters, a note of how many were cut (`… [19,998,000 more characters cut]`), and, when
    `tail` > 0, its last `tail` characters (the end of a traceback names the exception)."""
    text = safe_str(text)
    if limit < 0:
        raise ValueError("limit must be >= 0")
    if len(text) <= limit:
        return text
    tail = max(0, min(tail, limit))
    head = limit - tail
    removed = len(text) - limit
    if tail:
        return f"{text[:head]}… [{removed:,} characters cut] …{text[len(text) - tail:]}"
    return f"{text[:head]}… [{removed:,} more characters cut]"


def inert(text: Any, *, limit: int | None = None, multiline: bool = True, tail: int = 0) -> str:
    """`text` (any object: `safe_str` of it) with every control, bidirectional and separator
    character shown as its escape (see the module docstring), first cut to `limit` characters
    when given (`cut`). With `multiline`, newline and tab stay; without, they are shown too."""
    text = safe_str(text)
    if limit is not None:
        text = cut(text, limit, tail=tail)
    if multiline:
        if _UNSAFE_MULTILINE.search(text) is None:
            return text
        return _UNSAFE_MULTILINE.sub(_multiline_sub, text)
    if _UNSAFE.search(text) is None:
        return text
    return _UNSAFE.sub(lambda m: _visible(m.group()), text)


def is_inert(text: str, *, multiline: bool = True) -> bool:
    """Whether `text` holds no character `inert` would change."""
    pattern = _UNSAFE_MULTILINE if multiline else _UNSAFE
    return pattern.search(text) is None
