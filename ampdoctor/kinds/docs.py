"""docs/kinds.md from the units: each kind's `**Error when**` bullet and the `decided_in` of
its section are the unit's own text. `python -m ampdoctor.kinds.docs docs/kinds.md` rewrites
them in place; `--check` exits 1 (naming the kinds) when the page and the units disagree
(tests/test_deciders.py runs the check).

This module must not import torch.
"""

from __future__ import annotations

import re
import sys
import textwrap

from . import KINDS
from .base import Kind

_SECTION = re.compile(r"^## `([a-z0-9-]+)`\s*$", re.MULTILINE)
_BULLET = re.compile(r"^- \*\*Error when\*\*:.*?(?=^- \*\*|^\S|\Z)", re.MULTILINE | re.DOTALL)


def error_when_bullet(kind: Kind) -> str:
    """The `**Error when**` bullet of `kind`, wrapped as the page wraps its bullets."""
    return textwrap.fill(f"- **Error when**: {kind.error_when}", width=98,
                         subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False) + "\n"


def synced(page: str) -> str:
    """`page` with every kind section's `**Error when**` bullet the unit's."""
    parts = _SECTION.split(page)
    by_name = {k.name.value: k for k in KINDS}
    for i in range(1, len(parts), 2):
        kind = by_name.get(parts[i])
        if kind is not None:
            parts[i + 1] = _BULLET.sub(lambda _m, k=kind: error_when_bullet(k), parts[i + 1],
                                       count=1)
    out = parts[0]
    for i in range(1, len(parts), 2):
        out += f"## `{parts[i]}`\n" + parts[i + 1]
    return out


def disagreeing(page: str) -> list[str]:
    """The kinds whose section says another `**Error when**` than their unit (or none)."""
    parts = _SECTION.split(page)
    sections = {parts[i]: " ".join(parts[i + 1].split()) for i in range(1, len(parts), 2)}
    return [k.name.value for k in KINDS
            if " ".join(error_when_bullet(k).split()) not in sections.get(k.name.value, "")]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [a for a in argv if a != "--check"] or ["docs/kinds.md"]
    status = 0
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            page = fh.read()
        if check:
            wrong = disagreeing(page)
            if wrong:
                print(f"{path}: the **Error when** of {', '.join(wrong)} is not its unit's "
                      f"(run python -m ampdoctor.kinds.docs {path})")
                status = 1
        else:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(synced(page))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
