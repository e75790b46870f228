"""The reference of a script whose K and micro-batch are literals written in it, not options
(`ACCUM_STEPS = 4` and `BATCH_SIZE = 8` at its top, `batch_size = 8` inside `main()`, a config
dict `{"batch_size": 8, "grad_accum": 4}` or `dict(batch_size=8, ...)`, a config class's
attribute, a call's keywords: `TrainingArguments(per_device_train_batch_size=8,
gradient_accumulation_steps=4)`, `Accelerator(gradient_accumulation_steps=4)` with
`DataLoader(ds, batch_size=8)`): no command line runs it with K = 1. Its reference runs are
the script with those two literals changed (K to 1, the micro-batch to K x b), compiled from
the file's own text in the child (`compiled`): the same file, the same line numbers, the
user's file untouched.

A name counts when it is one of the option names that hold K or the micro-batch
(`init.script.K_FLAGS` / `BATCH_FLAGS`, case and dashes aside) and is set to a whole-number
literal exactly once in the script (two places: which one the run uses is not known; exit 2
naming both). Literals in a module the script imports are not read.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from typing import Any

from ..init.script import BATCH_FLAGS, K_FLAGS


@dataclass(frozen=True)
class Literal:
    """A whole-number literal the script sets a name to."""

    name: str
    value: int
    line: int
    col: int


def _normal(name: str) -> str:
    return name.replace("-", "_").lower()


def _int(node: ast.AST | None) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def literals(tree: ast.Module) -> list[Literal]:
    """Every `name = N`, `name: int = N`, `{"name": N}` and `f(name=N)` of the script whose
    name holds K or the micro-batch, N a whole-number literal."""
    wanted = set(K_FLAGS) | set(BATCH_FLAGS)
    found: list[Literal] = []

    def add(name: str, node: ast.expr | None) -> None:
        value = _int(node)
        if value is not None and _normal(name) in wanted and node is not None:
            found.append(Literal(name, value, node.lineno, node.col_offset))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                add(target.id, node.value)
            elif isinstance(target, ast.Attribute):          # self.batch_size = 8
                add(target.attr, node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            add(node.target.id, node.value)
        elif isinstance(node, ast.Dict):
            for key, item in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    add(key.value, item)
        elif isinstance(node, ast.Call):
            # dict(batch_size=8), TrainingArguments(gradient_accumulation_steps=4, ...),
            # Accelerator(gradient_accumulation_steps=4), DataLoader(ds, batch_size=8)
            for keyword in node.keywords:
                if keyword.arg:
                    add(keyword.arg, keyword.value)
    return found


def pick(found: list[Literal], names: tuple[str, ...]) -> Literal | list[Literal] | None:
    """The literal of the first of `names` (in their order) the script sets; all of them when
    it sets that name in several places; None when it sets none."""
    for wanted in names:
        matches = [f for f in found if _normal(f.name) == wanted]
        if len(matches) == 1:
            return matches[0]
        if matches:
            return matches
    return None


def compiled(source: str, filename: str, rewrites: list[tuple[str, str, int, int, int]]) -> Any:
    """The script's code with the literal at each (line, column) replaced by the new value
    (`rewrites`: (role, name, line, col, value)); line numbers are the file's."""
    tree = ast.parse(source, filename=filename)
    wanted = {(line, col): value for _, _, line, col, value in rewrites}
    seen: set[tuple[int, int]] = set()

    class Rewrite(ast.NodeTransformer):
        def visit_Constant(self, node: ast.Constant) -> ast.AST:
            key = (node.lineno, node.col_offset)
            if key in wanted and type(node.value) is int:
                seen.add(key)
                return ast.copy_location(ast.Constant(wanted[key]), node)
            return node

    tree = Rewrite().visit(tree)
    missing = set(wanted) - seen
    if missing:
        raise RuntimeError(f"{filename} changed during the diagnose: no whole-number literal "
                           f"at line {min(missing)[0]} any more")
    return compile(tree, filename, "exec")


def run_as_main(script: str, rewrites: list[tuple[str, str, int, int, int]]) -> None:
    """The script as `__main__` with some of its literals changed (`constants.compiled`), the
    way `runpy.run_path` runs a file: a fresh `__main__` module while it runs."""
    import builtins
    import types

    with open(script, encoding="utf-8") as f:
        code = compiled(f.read(), script, rewrites)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=script, __cached__=None, __loader__=None,
                           __package__=None, __spec__=None, __builtins__=builtins)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
