"""A kind is named by its unit (ampdoctor/kinds/) and everywhere else by `KindId`: no string
literal in ampdoctor/ outside the units is a kind's name, and the probe, which records what
happened and judges nothing, names no kind at all (its state machine names the illegal
transition; the rules read it as a kind).

The source is read with `ast` (nothing runs). A literal equal to a kind that is also a rung id
(`double-scaling`) is read as the rung.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ampdoctor.core.enums import KindId, RungId

PACKAGE = Path(__file__).resolve().parents[1] / "ampdoctor"
KIND_NAMES = {k.value for k in KindId} - {r.value for r in RungId}
#: files allowed their own spelling: the units and the enum that defines the names
OWNERS = ("kinds/", "core/enums.py")
#: files of another engineer's remit this branch leaves alone (to convert when merged)
PENDING: set[str] = set()


def bare_kinds(text: str, file: str) -> list[str]:
    """Each string literal of `text` that is a kind's name, as file:line 'name'."""
    return [f"{file}:{node.lineno} {node.value!r}" for node in ast.walk(ast.parse(text, file))
            if isinstance(node, ast.Constant) and node.value in KIND_NAMES]


def test_no_module_outside_the_units_spells_a_kind():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(OWNERS) or rel in PENDING:
            continue
        found += bare_kinds(path.read_text(encoding="utf-8"), rel)
    assert not found, "use KindId.NAME:\n" + "\n".join(found)


def test_the_probe_names_no_kind():
    for path in sorted((PACKAGE / "probe").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        froms = [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)]
        assert not any(alias.name == "KindId" for node in froms for alias in node.names), path
        assert not any((node.module or "").split(".")[-1] in ("kinds", "findings")
                       for node in froms), path
        assert not bare_kinds(text, path.name) and "double-scaling" not in text, path


def test_a_bare_kind_is_caught_with_its_line():
    assert bare_kinds("x = 1\nif f.kind == 'loop-error':\n    pass\n", "rules/x.py") == [
        "rules/x.py:2 'loop-error'"]
    assert bare_kinds("if f.kind == KindId.LOOP_ERROR:\n    pass\n", "rules/x.py") == []
