"""Reading literal values out of Python AST nodes, for the static scan (never evaluates code)."""

from __future__ import annotations

import ast
from typing import Any

from ampdoctor.core import thresholds
from ampdoctor.scan.configs import MISSING


def source_text(node: ast.AST, limit: int = 100) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001  # pragma: no cover - unparse handles every parsed tree
        return "<expr>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def const(node: ast.AST | None) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    return MISSING


def number(node: ast.AST) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(
        node.value, bool
    ):
        return float(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exp = number(node.left), number(node.right)
        if base is not None and exp is not None and abs(exp) <= 64:
            return base**exp
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        a, b = number(node.left), number(node.right)
        if a is not None and b is not None:
            return a * b
    return None


def power_of_two(value: float) -> bool:
    if value < 2 ** thresholds.MIN_LITERAL_SCALE_LOG2 or value != int(value):
        return False
    n = int(value)
    return n & (n - 1) == 0
