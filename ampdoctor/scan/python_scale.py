"""A hand-written static loss scale, read from the AST: a power-of-two constant (or a `*scale*`
name) multiplied into the loss on its way to backward, and `scaler.scale(...)` uses. A mixin of
the visitor in `python_ast`."""

from __future__ import annotations

import ast
import re

from ampdoctor.core import thresholds
from ampdoctor.scan.python_literals import number, power_of_two, source_text
from ampdoctor.scan.python_state import VisitorState
from ampdoctor.scan.sites import Site

_SCALE_NAME = re.compile(r"scale", re.I)


class LossScale(VisitorState):
    """Handlers for the loss on its way to backward."""

    # -- the loss on its way to backward ------------------------------------------------------
    def _backward(self, node: ast.Call) -> None:
        func = node.func
        assert isinstance(func, ast.Attribute)
        self.backward_line = node.lineno
        if node.args:
            self._loss_expr(node.args[0], node.lineno, 0)
        self._loss_expr(func.value, node.lineno, 0)

    def _scale_use(self, call: ast.Call, inside_backward: bool) -> None:
        func = call.func
        assert isinstance(func, ast.Attribute)
        receiver = source_text(func.value, 60)
        if not inside_backward:
            if "scaler" not in receiver.lower():
                return
            self.backward_line = call.lineno
        key = ("use", call.lineno, call.col_offset)
        if key in self.seen:
            return
        self.seen.add(key)
        self._add(Site("GradScaler", self.path, call.lineno, None,
                       f"{receiver}.scale(...) applied to the loss", "use", "gradscaler",
                       ref=receiver), call)
        self._loss_expr(call.args[0], call.lineno, 1)

    def _loss_expr(self, expr: ast.AST, before: int, depth: int) -> None:
        if depth > 4:
            return
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Attribute) and func.attr == "scale" and len(expr.args) == 1:
                self._scale_use(expr, inside_backward=True)
            return
        if isinstance(expr, ast.BinOp):
            factor = self._scale_factor(expr)
            if factor is not None:
                self._static(expr.lineno, factor)
                return
            for side in (expr.left, expr.right):
                if isinstance(side, (ast.Name, ast.BinOp)):
                    self._loss_expr(side, getattr(expr, "lineno", before), depth + 1)
            return
        if isinstance(expr, ast.Name):
            found = self._last_assign(expr.id, before)
            if found is None:
                return
            lineno, value, op = found
            if op is not None:
                if isinstance(op, ast.Mult):
                    factor = self._scale_operand(value)
                    if factor is not None:
                        self._static(lineno, factor)
                        return
                self._loss_expr(expr, lineno, depth + 1)
                return
            self._loss_expr(value, lineno, depth + 1)

    def _scale_factor(self, expr: ast.BinOp) -> str | None:
        if isinstance(expr.op, ast.Mult):
            for side in (expr.right, expr.left):
                factor = self._scale_operand(side)
                if factor is not None:
                    return factor
        for side in (expr.left, expr.right):
            if isinstance(side, ast.BinOp) and not isinstance(side.op, ast.Pow):
                factor = self._scale_factor(side)
                if factor is not None:
                    return factor
        return None

    def _scale_operand(self, node: ast.AST) -> str | None:
        value = number(node)
        if value is not None:
            return source_text(node, 30) if power_of_two(value) else None
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        if name is None or not _SCALE_NAME.search(name) or "scaler" in name.lower():
            return None
        if (isinstance(node, ast.Name) and name in self.numbers
                and self.numbers[name] < thresholds.MIN_NAMED_SCALE):
            return None
        text = source_text(node, 40)
        if isinstance(node, ast.Name) and name in self.numbers:
            text += f" = {self.numbers[name]:g}"
        return text

    def _static(self, lineno: int, factor: str) -> None:
        key = ("static", lineno, 0)
        if key in self.seen:
            return
        self.seen.add(key)
        self._add(Site("static loss scale", self.path, lineno, None,
                       f"the loss is multiplied by {factor} before backward "
                       f"(line {self.backward_line})",
                       "owner", "static"))
