"""The control flow the static hints read in one function of a syntax tree.

A *unit* is a function body (or the module's top level) without the functions, classes and
lambdas defined in it: those are units of their own, since their code runs when they are
called, not where they are written.

- `every_iteration(body, varying)`: the calls a loop makes on *every* iteration. A call under an
  `if` whose test can change from one iteration to the next (it reads a name the loop assigns,
  the loop variable, an attribute, a call, an index or an arithmetic expression such as
  `(i + 1) % K == 0`) runs on some iterations only; so does everything after an
  `if ...: continue` with such a test. A test made only of names set before the loop
  (`if use_fp16:`) is the same on every iteration: both arms count. Calls in a nested loop's
  body, an `except` handler or a `match` case do not count.
- `guarded_calls(body)`: every call of a loop body with the `if` tests it stands under
  (including the test of an earlier `if ...: continue`), nested loops included.
- `mod_divisor(test, assigns)`: the accumulation count a test selects windows by: `K` in
  `(i + 1) % K == 0`, directly or through a name assigned from such a comparison
  (`is_boundary = (step + 1) % K == 0`).
- Receivers: which `.step()` is an optimizer's, which a GradScaler's, which an LR
  scheduler's, read from the names (`optimizer`, `opt`, `scaler`, `lr_scheduler`) and from what
  a name was assigned (`torch.optim.lr_scheduler.LambdaLR(...)`, `GradScaler(...)`).

Nothing here imports torch or the scanned code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

#: The syntax that starts a unit of its own (its body is not the enclosing unit's code).
NESTED_UNITS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
LOOPS = (ast.For, ast.AsyncFor, ast.While)
#: Nodes a test may hold and still be the same on every iteration (with names the loop does
#: not assign).
_STEADY = (ast.Name, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Load, ast.boolop,
           ast.cmpop, ast.unaryop)
_EXITS = (ast.Continue, ast.Break, ast.Return, ast.Raise)
_TRY = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)

Assigns = dict[str, list[ast.expr]]


def own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under `node` (itself excluded) that is not inside a nested unit."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        yield child
        if not isinstance(child, NESTED_UNITS):
            stack.extend(ast.iter_child_nodes(child))


def own_calls(node: ast.AST) -> Iterator[ast.Call]:
    """The calls of one statement or expression (itself included), outside nested units."""
    if isinstance(node, ast.Call):
        yield node
    if isinstance(node, NESTED_UNITS):
        return
    for child in own_nodes(node):
        if isinstance(child, ast.Call):
            yield child


def units(tree: ast.Module) -> list[ast.AST]:
    """The module and every function in it, each read on its own."""
    return [tree] + [n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def target_names(target: ast.AST) -> Iterator[str]:
    """The names an assignment target binds, as source text (`loss`, `self.loss`)."""
    if isinstance(target, (ast.Name, ast.Attribute)):
        yield ast.unparse(target)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from target_names(elt)
    elif isinstance(target, ast.Starred):
        yield from target_names(target.value)


def assignments(unit: ast.AST) -> tuple[Assigns, set[str]]:
    """`name -> the values assigned to it` in the unit (an augmented `x /= K` as the BinOp
    `x / K`), and the names bound without a readable value (loop targets, `with ... as`,
    parameters)."""
    values: Assigns = {}
    opaque: set[str] = set()
    if isinstance(unit, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = unit.args
        for arg in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
            if arg is not None:
                opaque.add(arg.arg)
    for node in own_nodes(unit):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in target_names(target):
                    values.setdefault(name, []).append(node.value)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            for name in target_names(node.target):
                values.setdefault(name, []).append(node.value)
        elif isinstance(node, ast.AugAssign):
            for name in target_names(node.target):
                values.setdefault(name, []).append(
                    ast.BinOp(left=node.target, op=node.op, right=node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            opaque.update(target_names(node.target))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            opaque.update(target_names(node.optional_vars))
    return values, opaque


def loop_varying(loop: ast.AST) -> set[str]:
    """The names a loop (re)binds: its target and every name assigned in its body."""
    names: set[str] = set()
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        names.update(target_names(loop.target))
    for node in own_nodes(loop):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(target_names(target))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr, ast.For,
                               ast.AsyncFor)):
            names.update(target_names(node.target))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            names.update(target_names(node.optional_vars))
    return names


def steady(test: ast.expr, varying: set[str]) -> bool:
    """Is `test` the same on every iteration of a loop that binds `varying`?"""
    for node in ast.walk(test):
        if not isinstance(node, _STEADY):
            return False
        if isinstance(node, ast.Name) and node.id in varying:
            return False
    return True


def _exits(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], _EXITS)


def every_iteration(body: list[ast.stmt], varying: set[str]) -> Iterator[ast.Call]:
    """The calls `body` makes on every iteration of its loop (see the module docstring)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from own_calls(stmt.test)
            if not steady(stmt.test, varying):
                if _exits(stmt.body) or _exits(stmt.orelse):
                    return          # what follows runs on some iterations only
                continue
            yield from every_iteration(stmt.body, varying)
            yield from every_iteration(stmt.orelse, varying)
            if _exits(stmt.body) or _exits(stmt.orelse):
                return
        elif isinstance(stmt, LOOPS):
            yield from own_calls(stmt.iter if isinstance(stmt, (ast.For, ast.AsyncFor))
                                 else stmt.test)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                yield from own_calls(item.context_expr)
            yield from every_iteration(stmt.body, varying)
        elif isinstance(stmt, _TRY):
            yield from every_iteration(stmt.body + stmt.orelse + stmt.finalbody, varying)
        elif isinstance(stmt, ast.Match):
            yield from own_calls(stmt.subject)
        elif isinstance(stmt, NESTED_UNITS):
            continue
        elif isinstance(stmt, _EXITS):
            yield from own_calls(stmt)
            return
        else:
            yield from own_calls(stmt)


def guarded_calls(body: list[ast.stmt],
                  guards: tuple[ast.expr, ...] = ()) -> Iterator[tuple[ast.Call, tuple]]:
    """Every call of `body` (nested loops included, nested units not) with the `if` tests it
    stands under, an earlier `if ...: continue` counting as a test over the rest."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            for call in own_calls(stmt.test):
                yield call, guards
            inner = guards + (stmt.test,)
            yield from guarded_calls(stmt.body, inner)
            yield from guarded_calls(stmt.orelse, inner)
            if _exits(stmt.body) or _exits(stmt.orelse):
                guards = inner
        elif isinstance(stmt, LOOPS):
            head = stmt.iter if isinstance(stmt, (ast.For, ast.AsyncFor)) else stmt.test
            for call in own_calls(head):
                yield call, guards
            yield from guarded_calls(stmt.body + stmt.orelse, guards)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                for call in own_calls(item.context_expr):
                    yield call, guards
            yield from guarded_calls(stmt.body, guards)
        elif isinstance(stmt, _TRY):
            handlers: list[ast.stmt] = [s for h in stmt.handlers for s in h.body]
            yield from guarded_calls(stmt.body + handlers + stmt.orelse + stmt.finalbody, guards)
        elif isinstance(stmt, ast.Match):
            for case in stmt.cases:
                yield from guarded_calls(case.body, guards + (stmt.subject,))
        elif isinstance(stmt, NESTED_UNITS):
            continue
        else:
            for call in own_calls(stmt):
                yield call, guards


def _mod_in(expr: ast.AST) -> ast.expr | None:
    for node in ast.walk(expr):
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
                and not (isinstance(node.left, ast.Constant)
                         and isinstance(node.left.value, (str, bytes)))):
            return node.right
    return None


def mod_divisor(test: ast.expr, assigns: Assigns) -> ast.expr | None:
    """The `K` of a `... % K ...` in `test` or in the value of a name it reads."""
    found = _mod_in(test)
    if found is not None:
        return found
    for node in ast.walk(test):
        if isinstance(node, ast.Name):
            for value in assigns.get(node.id, ()):
                found = _mod_in(value)
                if found is not None:
                    return found
    return None


def last_name(expr: ast.AST) -> str:
    """`optimizer` for `optimizer`, `self.optimizer`, `optimizers[0]`; '' for others."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Subscript):
        return last_name(expr.value)
    return ""


def method(call: ast.Call, name: str) -> ast.expr | None:
    """The receiver of `receiver.name(...)`, or None when `call` is not that."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == name:
        return func.value
    return None


def _callee_name(value: ast.expr) -> str:
    return last_name(value.func) if isinstance(value, ast.Call) else ""


class Receivers:
    """What the receivers of `.step()` / `.zero_grad()` are, in one file."""

    def __init__(self, tree: ast.Module) -> None:
        self.schedulers: set[str] = set()
        self.constant_schedules: set[str] = set()
        self.scalers: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                receiver = method(node, "scale")
                if receiver is not None and len(node.args) == 1:
                    self.scalers.add(ast.unparse(receiver))
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            callee = _callee_name(node.value)
            names = [n for t in targets for n in target_names(t)]
            if callee.endswith(("GradScaler",)):
                self.scalers.update(names)
            elif callee.endswith(("LR", "Scheduler", "Schedule")) or "sched" in callee.lower():
                self.schedulers.update(names)
                if _constant_lambda(node.value):
                    self.constant_schedules.update(names)

    def is_scheduler(self, receiver: ast.expr) -> bool:
        text = ast.unparse(receiver)
        name = last_name(receiver).lower()
        return text in self.schedulers or ("sched" in name and "scaler" not in name)

    def is_scaler(self, receiver: ast.expr) -> bool:
        return ast.unparse(receiver) in self.scalers or "scaler" in last_name(receiver).lower()

    def optimizer_step(self, call: ast.Call) -> bool:
        """`optimizer.step()`, `opt.step()`, or `scaler.step(optimizer)`."""
        receiver = method(call, "step")
        if receiver is None or self.is_scheduler(receiver):
            return False
        if self.is_scaler(receiver):
            return bool(call.args)
        return "opt" in last_name(receiver).lower()

    def zero_grad(self, call: ast.Call) -> bool:
        """`optimizer.zero_grad()` or `model.zero_grad()` (not accelerate's, which knows the
        window)."""
        receiver = method(call, "zero_grad")
        return receiver is not None and "accelerator" not in last_name(receiver).lower()

    def constant(self, receiver: ast.expr) -> bool:
        return ast.unparse(receiver) in self.constant_schedules


def _constant_lambda(value: ast.expr) -> bool:
    """`LambdaLR(optimizer, lambda step: 1.0)`: a factor that ignores the step count, so the
    LR is the same however often the scheduler steps."""
    if not isinstance(value, ast.Call) or _callee_name(value) != "LambdaLR":
        return False
    given = [k.value for k in value.keywords if k.arg == "lr_lambda"] or value.args[1:2]
    if len(given) != 1 or not isinstance(given[0], ast.Lambda):
        return False
    fn = given[0]
    params = {a.arg for a in fn.args.posonlyargs + fn.args.args}
    return not any(isinstance(n, ast.Name) and n.id in params for n in ast.walk(fn.body))
