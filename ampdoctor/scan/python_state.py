"""What the Python visitor knows while it reads one file, and the helpers every part of it uses:
the import aliases, the literal dicts and numbers, the `if` arms and scope it stands in, and how
a site is added. The visitor in `python_ast` and its mixins (`python_owners`, `python_scale`)
share it."""

from __future__ import annotations

import ast
from typing import Any

from ampdoctor.scan.configs import MISSING, NonLiteral
from ampdoctor.scan.python_literals import const, source_text
from ampdoctor.scan.sites import FileScan, Site

#: An assignment to a name: its line, the value, and the operator of an augmented one.
Assignment = tuple[int, ast.expr, ast.operator | None]


class VisitorState:
    """The state of one pass over one file's syntax tree."""

    def __init__(self, path: str, scan: FileScan) -> None:
        self.path = path
        self.scan = scan
        self.aliases: dict[str, str] = {}
        self.dicts: dict[str, ast.Dict] = {}
        self.numbers: dict[str, float] = {}
        self.branch: list[tuple[tuple[int, int], int]] = []
        self.scope: ast.AST | None = None
        self.scopes: list[ast.AST] = []
        self.calls: list[tuple[ast.Call, tuple, ast.AST | None]] = []
        self._assigns: dict[int, dict[str, list[Assignment]]] = {}
        self.handed: dict[int, str] = {}
        self.seen: set[tuple[str, int, int]] = set()
        self.ds_strategy = False
        self.lightning: list[Site] = []
        self.backward_line = 0
        self.inlined: set[int] = set()
        self.local_classes: set[str] = set()

    def qual(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.qual(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def _add(self, site: Site, node: ast.AST | None = None) -> Site:
        if node is not None:
            site.end_line = getattr(node, "end_lineno", None)
        site.branch = tuple(self.branch)
        self.scan.sites.append(site)
        return site

    def _value(self, node: ast.AST) -> Any:
        value = const(node)
        return NonLiteral(source_text(node, 60)) if value is MISSING else value

    def _scope_assigns(self) -> dict[str, list[Assignment]]:
        scope = self.scopes[-1]
        cached = self._assigns.get(id(scope))
        if cached is not None:
            return cached
        table: dict[str, list[Assignment]] = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        table.setdefault(target.id, []).append((node.lineno, node.value, None))
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                table.setdefault(node.target.id, []).append((node.lineno, node.value, node.op))
            elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                  and node.value):
                table.setdefault(node.target.id, []).append((node.lineno, node.value, None))
        for entries in table.values():
            entries.sort(key=lambda e: e[0])
        self._assigns[id(scope)] = table
        return table

    def _last_assign(self, name: str, before: int) -> Assignment | None:
        found = None
        for entry in self._scope_assigns().get(name, ()):
            if entry[0] < before:
                found = entry
            else:
                break
        return found
