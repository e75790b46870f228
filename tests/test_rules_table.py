"""The rule table: every kind of the contract has exactly one decider, named as an importable
`module:function`, and that function is the only place a `Finding` of the kind is built.

The contract's kinds are the table of docs/kinds.md (the user-facing copy); the catalogue and
the registry (`RULES`) must hold exactly those. The source of ampdoctor/ is read with `ast`
(nothing of it runs): every `Finding(...)` call, every finding record written as a dict with a
literal `"kind"`, and every `replace(..., kind=...)` is a place that builds a finding. Each must
name its kind as a literal (a string or `KindId.NAME`) and stand in the registered decider of
that kind; a second place, a kind read from a variable, or a decider that never builds its kind
fails with the kind and the file:line.
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from ampdoctor.core.findings import Finding, KindId
from ampdoctor.kinds import CATALOGUE, RULES, Observed

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ampdoctor"
KINDS_DOC = ROOT / "docs" / "kinds.md"


def contract_kinds() -> list[str]:
    """The kinds of docs/kinds.md's table, in its order: rows like
    | [`kind`](#kind) | rungs | severity |."""
    rows = re.findall(r"^\| \[`([a-z0-9-]+)`\]\(#[a-z0-9-]+\) \|", KINDS_DOC.read_text(),
                      re.MULTILINE)
    assert rows, "no kinds table in docs/kinds.md"
    return rows


def test_catalogue_docs_and_registry_hold_the_same_kinds():
    documented = contract_kinds()
    assert len(documented) == len(set(documented)), "a kind is listed twice in docs/kinds.md"
    assert set(CATALOGUE) == set(documented)
    assert set(RULES) == set(CATALOGUE)
    assert all(rule.kind == kind for kind, rule in RULES.items())


def _decider(kind: str):
    module, sep, function = RULES[kind].decided_in.partition(":")
    assert sep and module and function, (kind, RULES[kind].decided_in)
    return module, function


@pytest.mark.parametrize("kind", list(RULES))
def test_decided_in_imports_to_a_callable_that_decides_the_kind(kind):
    module, function = _decider(kind)
    decider = getattr(importlib.import_module(module), function, None)
    assert callable(decider), f"{kind}: {RULES[kind].decided_in} is not a callable"
    finding = decider(Observed("fp32-accum", "error", "a message", evidence={"measured": 1}))
    assert isinstance(finding, Finding) and finding.kind == kind
    assert finding.message == "a message" and finding.evidence == {"measured": 1}


# --- where findings are built ---------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    """One place that builds a finding: its kind (None when not a literal), file:line and the
    function it stands in (dotted for a method)."""

    kind: str | None
    file: str
    line: int
    function: str | None

    def where(self) -> str:
        return f"{self.file}:{self.line}" + (f" ({self.function})" if self.function else "")


def _literal(node: ast.expr | None) -> str | None:
    """A string written in the source: a constant, or a member of `KindId` named as
    `KindId.NAME` (its value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "KindId" and node.attr in KindId.__members__):
        return KindId[node.attr].value
    return None


def _called(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self, file: str) -> None:
        self.file = file
        self.scope: list[str] = []
        self.built: list[Built] = []

    def _add(self, kind: str | None, node: ast.AST) -> None:
        self.built.append(Built(kind, self.file, node.lineno,  # type: ignore[attr-defined]
                                ".".join(self.scope) or None))

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        name = _called(node)
        keyword = next((k.value for k in node.keywords if k.arg == "kind"), None)
        if name == "Finding":
            # the kind: the second argument or `kind=` (a `*args` / `**data` may hide it)
            kind_node = node.args[1] if len(node.args) > 1 else keyword
            hidden = any(isinstance(a, ast.Starred) for a in node.args[:2])
            self._add(None if hidden else _literal(kind_node), node)
        elif name == "replace" and keyword is not None:
            self._add(_literal(keyword), node)     # a finding copied under another kind
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values, strict=True):
            if _literal(key) == "kind" and _literal(value) in CATALOGUE:
                self._add(_literal(value), node)   # a finding record written by hand
        self.generic_visit(node)


def built_in(sources: dict[str, str]) -> list[Built]:
    """Every place in `sources` (path relative to the repository -> text) that builds a
    finding."""
    built: list[Built] = []
    for file, text in sorted(sources.items()):
        scan = _Scan(file)
        scan.visit(ast.parse(text, file))
        built += scan.built
    return built


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def problems(sources: dict[str, str]) -> list[str]:
    """What breaks "one decision per kind" in `sources`: a finding built outside its kind's
    registered decider, a kind that is not a literal, a decider that never builds its kind."""
    deciders = {}
    for kind in RULES:
        module, function = _decider(kind)
        deciders[kind] = (module.replace(".", "/") + ".py", function)
    out = []
    built = built_in(sources)
    for b in built:
        if b.kind is None:
            out.append(f"{b.where()}: builds a finding whose kind is not a literal; call the "
                       "kind's decider (or kinds.decide) instead")
        elif b.kind not in RULES:
            out.append(f"{b.where()}: builds a finding of {b.kind!r}, a kind not in the "
                       "contract")
        elif (b.file, b.function) != deciders[b.kind]:
            out.append(f"{b.kind}: decided at {b.where()} besides its decider "
                       f"{RULES[b.kind].decided_in}")
    for kind, (file, function) in deciders.items():
        if not any(b.kind == kind and (b.file, b.function) == (file, function) for b in built):
            out.append(f"{kind}: its decider {RULES[kind].decided_in} never builds it")
    return out


def test_each_kind_is_built_in_its_decider_and_nowhere_else():
    found = problems(package_sources())
    assert not found, "\n".join(found)


def test_a_second_decision_site_fails_with_the_kind_and_the_line():
    sources = package_sources()
    sources["ampdoctor/rules/stray.py"] = (
        "from ..findings import Finding\n"
        "\n"
        "def stray(rung):\n"
        "    return Finding(rung, \"double-average\", \"error\", \"averaged twice\")\n")
    assert problems(sources) == [
        "double-average: decided at ampdoctor/rules/stray.py:4 (stray) besides its decider "
        "ampdoctor.kinds.accumulation:double_average"]


def test_a_kind_from_a_variable_or_a_hand_written_record_fails():
    sources = package_sources()
    sources["ampdoctor/rules/stray.py"] = (
        "def stray(rung, kind, Finding):\n"
        "    a = Finding(rung, kind, \"error\", \"?\")\n"
        "    b = {\"rung\": rung, \"kind\": \"loop-error\", \"severity\": \"error\"}\n"
        "    return a, b\n")
    found = problems(sources)
    assert len(found) == 2
    assert found[0].startswith("ampdoctor/rules/stray.py:2 (stray): builds a finding whose "
                               "kind is not a literal")
    assert found[1] == ("loop-error: decided at ampdoctor/rules/stray.py:3 (stray) besides "
                        "its decider ampdoctor.kinds.loop_error:loop_error")


def test_a_decider_that_builds_another_kind_fails_for_both_kinds():
    sources = package_sources()
    text = sources["ampdoctor/kinds/accumulation.py"]
    wrong = text.replace("Finding(seen.rung, KindId.DOUBLE_AVERAGE",
                         "Finding(seen.rung, KindId.MISSING_ACCUMULATION_AVERAGE", 1)
    assert wrong != text
    sources["ampdoctor/kinds/accumulation.py"] = wrong
    found = problems(sources)
    assert any(p.startswith("missing-accumulation-average: decided at "
                            "ampdoctor/kinds/accumulation.py:")
               and "(double_average)" in p for p in found), found
    assert ("double-average: its decider ampdoctor.kinds.accumulation:double_average never "
            "builds it") in found
