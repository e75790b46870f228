"""Static hints: four classic accumulation + AMP mistakes `ampdoctor scan` can see in the code
without running it, reported as **warnings** with the file and line (docs/scan.md says the same
for users). A hint is a pattern, not a measurement: `ampdoctor diagnose` measures what it costs.

An *accumulation loop* is a loop whose every iteration runs a loss backward (`loss.backward()`,
`scaler.scale(loss).backward()`) while the optimizer steps on some iterations only, chosen by
a modulo test (`if (i + 1) % K == 0:`, a flag assigned from one, or an `if ...: continue`
before the step), or a loop that runs a backward on every iteration, never steps, and is
followed in its function by the optimizer step (`for micro_step in range(K): ...`; then `K` is
the `range` bound). In such a loop:

- `scheduler-per-microbatch`: an LR scheduler's `.step()` runs on every iteration (a
  `LambdaLR` whose factor ignores the step count is exempt: its LR never changes);
- `zero-grad-inside-accumulation`: `.zero_grad()` runs on every iteration, wiping the window;
- `missing-accumulation-average`: the loss that reaches backward is divided (or multiplied) by
  nothing, in its expression or in any assignment of the names it comes from. A loss built by a
  function of the same file that divides, or by a call handed `K`, counts as divided.

And in any function:

- `clip-before-unscale`: `clip_grad_norm_` / `clip_grad_value_` / `clip_grads_with_norm_`
  (torch.nn.utils') stands after a `scaler.scale(...).backward()` and before that scaler's
  `.step(...)`, with no `scaler.unscale_(...)` in between, and not in the other arm of an `if`
  from the step. A threshold multiplied by `scaler.get_scale()` clips consistently in scaled
  space and is exempt.

This module must not import torch.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ampdoctor.core.enums import KindId
from ampdoctor.core.findings import Finding, Location
from ampdoctor.kinds.accumulation import UndividedLoss, undivided_loss
from ampdoctor.kinds.base import AccumulationLoop
from ampdoctor.kinds.clipping import ClipInCode, clip_in_code
from ampdoctor.kinds.schedule import SchedulerInLoop, scheduler_in_loop
from ampdoctor.kinds.stepping import ZeroGradInLoop, zero_grad_in_loop
from ampdoctor.scan import hints_flow as flow
from ampdoctor.scan.hints_flow import Assigns, Receivers

#: What a hint saw: the typed observation of its kind's unit, which words and decides it.
Seen = SchedulerInLoop | ZeroGradInLoop | UndividedLoss | ClipInCode

#: observation type -> its kind and its unit's function
_UNITS: dict[type, tuple[KindId, Callable[[Any], Finding]]] = {
    ClipInCode: (KindId.CLIP_BEFORE_UNSCALE, clip_in_code),
    SchedulerInLoop: (KindId.SCHEDULER_PER_MICROBATCH, scheduler_in_loop),
    UndividedLoss: (KindId.MISSING_ACCUMULATION_AVERAGE, undivided_loss),
    ZeroGradInLoop: (KindId.ZERO_GRAD_INSIDE_ACCUMULATION, zero_grad_in_loop),
}
HINT_KINDS = tuple(kind for kind, _ in _UNITS.values())
CLIP_FUNCTIONS = frozenset({"clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"})
_NORMALISING_CALLS = frozenset({"div", "div_", "divide", "true_divide", "mul", "mul_",
                                "multiply"})


@dataclass(frozen=True)
class Hint:
    """One static hint in one file: what it saw and the function it stands in (the finding is
    built from it by `hint_findings`, through its kind's unit)."""

    seen: Seen
    function: str | None = None

    @property
    def kind(self) -> KindId:
        return _UNITS[type(self.seen)][0]

    @property
    def line(self) -> int:
        return self.seen.line

    def finding(self, path: str) -> Finding:
        """The finding of the hint in the file at `path`, decided by its kind's unit."""
        seen = replace(self.seen, location=Location(path, self.seen.line, self.function,
                                                    self.seen.code))
        return _UNITS[type(seen)][1](seen)


@dataclass
class _Window:
    loop: ast.For | ast.AsyncFor | ast.While
    divisor: ast.expr | None
    step: ast.Call                 # the optimizer step (the first after the loop, without a test)
    test: ast.expr | None          # the test that selects the stepping iterations
    every: list[ast.Call]

    def seen(self) -> AccumulationLoop:
        k = ast.unparse(self.divisor) if self.divisor is not None else None
        if self.test is None:
            return AccumulationLoop(self.loop.lineno, self.step.lineno, k)
        return AccumulationLoop(self.loop.lineno, self.step.lineno, k, ast.unparse(self.test),
                                self.test.lineno)


def find_hints(tree: ast.Module, aliases: dict[str, str] | None = None) -> list[Hint]:
    """Every hint in one parsed file, in line order."""
    receivers = Receivers(tree)
    functions: dict[str, ast.AST] = {
        n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: dict[tuple[str, int], Hint] = {}
    for unit in flow.units(tree):
        name = getattr(unit, "name", None)
        assigns, opaque = flow.assignments(unit)
        for window in _windows(unit, assigns, receivers):
            for hint in _window_hints(window, assigns, opaque, receivers, functions):
                found.setdefault((hint.kind, hint.line), _named(hint, name))
        for hint in _clip_hints(unit, receivers, aliases or {}):
            found.setdefault((hint.kind, hint.line), _named(hint, name))
    return sorted(found.values(), key=lambda h: (h.line, h.kind))


def _named(hint: Hint, function: str | None) -> Hint:
    return hint if function is None else replace(hint, function=function)


# -- accumulation loops -----------------------------------------------------------------------

def _backward_loss(call: ast.Call) -> ast.expr | None:
    """The loss of `loss.backward()` / `scaler.scale(loss).backward()`; None for a framework's
    `accelerator.backward(loss)` (it handles the window itself) or another call."""
    receiver = flow.method(call, "backward")
    if receiver is None or call.args:
        return None
    if isinstance(receiver, ast.Call):
        inner = flow.method(receiver, "scale")
        if inner is not None and len(receiver.args) == 1:
            return receiver.args[0]
    return receiver


def _windows(unit: ast.AST, assigns: Assigns, receivers: Receivers) -> list[_Window]:
    steps_after = [n for n in flow.own_nodes(unit)
                   if isinstance(n, ast.Call) and receivers.optimizer_step(n)]
    out = []
    for loop in flow.own_nodes(unit):
        if not isinstance(loop, flow.LOOPS):
            continue
        every = list(flow.every_iteration(loop.body, flow.loop_varying(loop)))
        if not any(_backward_loss(c) is not None for c in every):
            continue
        steps = [(c, g) for c, g in flow.guarded_calls(loop.body) if receivers.optimizer_step(c)]
        if steps:
            if any(c in every for c, _ in steps):
                continue                    # it steps on every micro-batch: no window here
            window = _modulo_window(loop, steps, assigns, every)
            if window is not None:
                out.append(window)
            continue
        end = getattr(loop, "end_lineno", None) or loop.lineno
        later = [c for c in steps_after if c.lineno > end]
        if later:
            out.append(_Window(loop, _range_bound(loop), later[0], None, every))
    return out


def _modulo_window(loop: ast.For | ast.AsyncFor | ast.While,
                   steps: list[tuple[ast.Call, tuple]], assigns: Assigns,
                   every: list[ast.Call]) -> _Window | None:
    for call, guards in steps:
        for test in guards:
            divisor = flow.mod_divisor(test, assigns)
            if divisor is not None:
                return _Window(loop, divisor, call, test, every)
    return None


def _range_bound(loop: ast.AST) -> ast.expr | None:
    """`K` of `for _ in range(K)` / `range(0, K)`."""
    if not isinstance(loop, (ast.For, ast.AsyncFor)) or not isinstance(loop.iter, ast.Call):
        return None
    call = loop.iter
    if not (isinstance(call.func, ast.Name) and call.func.id == "range") or call.keywords:
        return None
    if len(call.args) == 1:
        return call.args[0]
    if len(call.args) == 2 and isinstance(call.args[0], ast.Constant) and call.args[0].value == 0:
        return call.args[1]
    return None


def _window_hints(window: _Window, assigns: Assigns, opaque: set[str], receivers: Receivers,
                  functions: dict[str, ast.AST]) -> list[Hint]:
    loop = window.seen()
    hints = []
    for call in window.every:
        receiver = flow.method(call, "step")
        if (receiver is not None and receivers.is_scheduler(receiver)
                and not receivers.constant(receiver)):
            hints.append(Hint(SchedulerInLoop(call.lineno, ast.unparse(call), loop)))
        elif receivers.zero_grad(call):
            hints.append(Hint(ZeroGradInLoop(call.lineno, ast.unparse(call), loop)))
    if window.divisor is None:
        return hints
    k_names = {n.id for n in ast.walk(window.divisor) if isinstance(n, ast.Name)}
    k_names.add(loop.k_text)
    for call in window.every:
        loss = _backward_loss(call)
        if loss is None or _normalised(loss, assigns, opaque, functions, k_names, set()):
            continue
        hints.append(Hint(UndividedLoss(call.lineno, ast.unparse(call), ast.unparse(loss),
                                        loop)))
    return hints


def _divides(expr: ast.AST) -> bool:
    for node in ast.walk(expr):
        if (isinstance(node, (ast.BinOp, ast.AugAssign))
                and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mult))):
            return True
        if isinstance(node, ast.Call) and flow.last_name(node.func) in _NORMALISING_CALLS:
            return True
    return False


def _normalised(expr: ast.expr, assigns: Assigns, opaque: set[str],
                functions: dict[str, ast.AST], k_names: set[str], seen: set[str]) -> bool:
    """Is the loss `expr` divided (or multiplied) by anything on its way to backward? A value
    the file does not show (a parameter, a loop variable) counts as divided: no hint on
    guesses."""
    if _divides(expr):
        return True
    if isinstance(expr, ast.Call):
        func = expr.func
        called = [*expr.args, *(k.value for k in expr.keywords)]
        if any(isinstance(n, ast.Name) and n.id in k_names
               for a in called for n in ast.walk(a)):
            return True                     # it is handed K: it may divide by it
        name = flow.last_name(func)
        defined = functions.get(name)
        if defined is not None:
            return _divides(defined)
        if isinstance(func, ast.Attribute) and not isinstance(func.value, ast.Name):
            return _normalised(func.value, assigns, opaque, functions, k_names, seen)
        if isinstance(func, ast.Attribute) and func.attr in ("float", "mean", "sum", "double",
                                                             "to", "squeeze", "clone"):
            return _normalised(func.value, assigns, opaque, functions, k_names, seen)
        return False
    if isinstance(expr, (ast.Attribute, ast.Name)):
        text = ast.unparse(expr)
        if text in opaque:
            return True                     # a parameter or a loop variable: not seen here
        if text in seen:
            return False
        if text in assigns:
            seen.add(text)
            return any(_normalised(v, assigns, opaque, functions, k_names, seen)
                       for v in assigns[text])
        if isinstance(expr, ast.Attribute):
            return _normalised(expr.value, assigns, opaque, functions, k_names, seen)
        return True                         # a parameter, a loop variable, a global: unseen
    if isinstance(expr, ast.Subscript):
        return _normalised(expr.value, assigns, opaque, functions, k_names, seen)
    if isinstance(expr, (ast.BinOp, ast.UnaryOp, ast.IfExp)):
        parts = ([expr.left, expr.right] if isinstance(expr, ast.BinOp)
                 else [expr.operand] if isinstance(expr, ast.UnaryOp) else [expr.body, expr.orelse])
        return any(_normalised(p, assigns, opaque, functions, k_names, seen) for p in parts)
    return True


# -- clipping before unscale_ -------------------------------------------------------------------

def _branches(unit: ast.AST) -> dict[int, tuple[tuple[int, int], ...]]:
    """`id(call) -> the (if, arm) pairs it stands in`, for the calls of one unit."""
    out: dict[int, tuple[tuple[int, int], ...]] = {}

    def visit(node: ast.AST, arms: tuple[tuple[int, int], ...]) -> None:
        if isinstance(node, flow.NESTED_UNITS):
            return
        if isinstance(node, ast.Call):
            out[id(node)] = arms
        if isinstance(node, ast.If):
            visit(node.test, arms)
            for index, body in enumerate((node.body, node.orelse)):
                for stmt in body:
                    visit(stmt, arms + ((id(node), index),))
            return
        for child in ast.iter_child_nodes(node):
            visit(child, arms)

    for child in ast.iter_child_nodes(unit):
        visit(child, ())
    return out


def _exclusive(a: tuple, b: tuple) -> bool:
    arms = dict(a)
    return any(bid in arms and arms[bid] != arm for bid, arm in b)


def _is_torch_clip(call: ast.Call, aliases: dict[str, str]) -> bool:
    """torch.nn.utils' clipping (under any import alias), not a framework's own method
    (`accelerator.clip_grad_norm_` unscales first)."""
    func = call.func
    if isinstance(func, ast.Name):
        qual = aliases.get(func.id, "")
        return qual.startswith("torch.") and qual.rsplit(".", 1)[-1] in CLIP_FUNCTIONS
    if isinstance(func, ast.Attribute) and func.attr in CLIP_FUNCTIONS:
        base = ast.unparse(func.value)
        head = base.split(".")[0]
        return base.endswith(("utils", "clip_grad")) or aliases.get(head, head) == "torch"
    return False


def _threshold(call: ast.Call) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg in ("max_norm", "clip_value"):
            return kw.value
    return call.args[1] if len(call.args) > 1 else None


def _clip_hints(unit: ast.AST, receivers: Receivers, aliases: dict[str, str]) -> list[Hint]:
    calls = sorted((n for n in flow.own_nodes(unit) if isinstance(n, ast.Call)),
                   key=lambda c: (c.lineno, c.col_offset))
    if not any(_is_torch_clip(c, aliases) for c in calls):
        return []
    arms = _branches(unit)
    position = {id(c): i for i, c in enumerate(calls)}
    hints = []
    for clip in (c for c in calls if _is_torch_clip(c, aliases)):
        threshold = _threshold(clip)
        if threshold is not None and any(flow.method(n, "get_scale") is not None
                                         for n in ast.walk(threshold)
                                         if isinstance(n, ast.Call)):
            continue                        # a scaled threshold for scaled gradients
        here = position[id(clip)]
        backward = next((c for c in reversed(calls[:here]) if _scaled_backward(c)), None)
        if backward is None:
            continue
        assert isinstance(backward.func, ast.Attribute)
        scale_call = backward.func.value
        assert isinstance(scale_call, ast.Call) and isinstance(scale_call.func, ast.Attribute)
        scaler = ast.unparse(scale_call.func.value)
        start = position[id(backward)]
        if any(_on(c, "unscale_", scaler) for c in calls[start:here]):
            continue
        step = next((c for c in calls[here + 1:] if _on(c, "step", scaler)
                     and not _exclusive(arms[id(c)], arms[id(clip)])), None)
        if step is None or _exclusive(arms[id(backward)], arms[id(clip)]):
            continue
        hints.append(Hint(ClipInCode(clip.lineno, ast.unparse(clip), flow.last_name(clip.func),
                                     scaler, backward.lineno, ast.unparse(step), step.lineno)))
    return hints


def _scaled_backward(call: ast.Call) -> bool:
    receiver = flow.method(call, "backward")
    return (isinstance(receiver, ast.Call) and flow.method(receiver, "scale") is not None
            and len(receiver.args) == 1)


def _on(call: ast.Call, name: str, scaler: str) -> bool:
    receiver = flow.method(call, name)
    return receiver is not None and ast.unparse(receiver) == scaler


def hint_findings(scans: Any) -> list[Finding]:
    """The `warning` findings of the hints of the scanned files (`{path: FileScan}`), by file
    and line; each decided and worded by its kind's unit."""
    return [hint.finding(path) for path in sorted(scans) for hint in scans[path].hints]
