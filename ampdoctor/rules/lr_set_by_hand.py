"""Rule `scheduler-per-microbatch` for a learning rate the loop sets by hand
(`for g in optimizer.param_groups: g["lr"] = get_lr(it)`), with no scheduler object to count.

The step state machine allows the learning rate to change only at a window's boundary: between
two optimizer steps the K micro-batches all train towards the same update. A loop that computes
its rate from a micro-batch counter (`it` incremented per micro-batch, `enumerate(loader)`'s
index) sets a different value on each micro-batch of a window, and its warm-up and decay run
about K times too fast in optimizer steps. Seen that way (the probe reads parameter group 0's
rate at every backward), the rule measures the consequence the same way script mode does: the
same loop at K = 1, each window's data as one micro-batch, sets the rate its author meant for
each optimizer step; the finding is an error when a step used another rate, and names the line
that assigns it.
"""

from __future__ import annotations

import ast
import bisect
import inspect
import linecache
import textwrap
from typing import Any

from ..core import thresholds
from ..core.findings import Finding, Location, location
from ..kinds import schedule
from ..loading.data import merge_micro_batches
from ..probe.events import Backward
from ..session import Session, Trace


def _step_lrs(trace: Any, slot: int) -> list[tuple[int, float]]:
    """(seq, lr of parameter group 0) of the first step of each step group of optimizer
    `slot`, in order, from a Trace's steps or a script run's (`Outcome.steps`)."""
    seen: dict[int, tuple[int, float]] = {}
    for s in trace.steps:
        if s.optimizer == slot and s.lrs and s.group not in seen:
            seen[s.group] = (s.seq, float(s.lrs[0]))
    return list(seen.values())


def _changes_inside_windows(trace: Trace, slot: int, steps: list[tuple[int, float]]
                            ) -> tuple[int, int, list[float], Any] | None:
    """The first window (its index) in which the rate took more than one value across the
    backwards before its step, how many values it took at most in one window, that window's
    values and the site of the backward that first saw a new one; None when the rate never
    changed inside a window."""
    ends = [seq for seq, _ in steps]
    values: list[list[float]] = [[] for _ in ends]
    sites: list[Any] = [None] * len(ends)
    for e in trace.events_of(Backward):
        lr = e.lrs[slot] if len(e.lrs) > slot else None
        window = bisect.bisect_left(ends, e.seq)     # the first step after this backward
        if lr is None or window == len(ends):
            continue
        seen = values[window]
        if not seen or _differs(seen[-1], lr):
            seen.append(lr)
            if len(seen) == 2:
                sites[window] = e.site
    changed = [w for w, seen in enumerate(values) if len(seen) > 1]
    if not changed:
        return None
    first = changed[0]
    return first, max(len(values[w]) for w in changed), values[first], sites[first]


def _differs(a: float, b: float) -> bool:
    return abs(a - b) > thresholds.LR_RTOL * max(abs(a), abs(b), 1e-30)


def lr_set_by_hand_findings(session: Session, trace: Trace, rung: str) -> list[Finding]:
    """A finding when the loop changed an optimizer's rate between the micro-batches of a
    window and an optimizer step used another rate than the same loop at K = 1 gives it."""
    if session.K < 2 or not trace.steps:
        return []
    for slot in sorted({s.optimizer for s in trace.steps}):
        steps = _step_lrs(trace, slot)
        inside = _changes_inside_windows(trace, slot, steps)
        if inside is None:
            continue
        window, most, values, site = inside
        merged = [merge_micro_batches(session.window(w)) for w in range(session.N)]
        if any(m is None for m in merged):
            return []        # ragged windows: no K = 1 run to measure the consequence with
        once = session.run_loop("fp32", micro_batches=merged, K=1, capture=False)
        if once.error is not None:
            return []
        finding = _judge(session, trace, rung, slot, steps, inside, once)
        if finding is not None:
            return [finding]
    return []


def rate_set_per_micro_batch_against(session: Session, trace: Trace, rung: str,
                                     reference: Any) -> tuple[bool, Finding | None]:
    """The same judgement for optimizer 0 against a K = 1 run made elsewhere (script mode's
    reference: the script at K = 1 and batch K x b): (True, the finding or None) when the rate
    changed between the micro-batches of a window, so this rule and no other judges it (a rate
    less than a step of the schedule off is harmless); (False, None) when it never did."""
    if session.K < 2 or not trace.steps:
        return False, None
    steps = _step_lrs(trace, 0)
    inside = _changes_inside_windows(trace, 0, steps)
    if inside is None:
        return False, None
    return True, _judge(session, trace, rung, 0, steps, inside, reference)


def _judge(session: Session, trace: Trace, rung: str, slot: int,
           steps: list[tuple[int, float]], inside: tuple[int, int, list[float], Any],
           once: Any) -> Finding | None:
    window, most, values, site = inside
    meant = [lr for _, lr in _step_lrs(once, slot)]
    for n, (_, used) in enumerate(steps[:len(meant)]):
        if _beyond_a_step(used, meant, n):
            return _finding(session, trace, rung, slot, n, used, meant[n], window, most,
                            values, site)
    return None


def _beyond_a_step(used: float, meant: list[float], n: int) -> bool:
    """Whether step `n`'s rate lies outside what the schedule gives between the step before
    and the step after it: a rate read from a fractional step (`it / K`) is less than a step
    off and harmless; one counted in micro-batches is K - 1 steps ahead from the first step.
    The last step compared has no step after it in the K = 1 run: the schedule's pace from
    the step before stands in for it."""
    near = meant[max(0, n - 1):n + 2]
    if n + 1 >= len(meant) and n >= 1:
        near.append(2 * meant[n] - meant[n - 1])
    low, high = min(near), max(near)
    return _differs(used, min(max(used, low), high))


def _finding(session: Session, trace: Trace, rung: str, slot: int, step: int, used: float,
             meant: float, window: int, most: int, values: list[float], site: Any) -> Finding:
    several = len({s.optimizer for s in trace.steps}) > 1
    return schedule.rate_set_per_micro_batch(schedule.RateSetPerMicroBatch(
        rung, trace.precision, session.K, window, most, tuple(values), step, used, meant,
        slot if several else None, lr_assignment(session) or location(site)))


def lr_assignment(session: Session) -> Location | None:
    """The line of the training loop's function that assigns a learning rate
    (`group["lr"] = ...`, `param_group.update(lr=...)`); None when it has none (the rate is set
    elsewhere)."""
    loop = getattr(session.code, "train_loop", None)
    script = getattr(session.code, "script", None)
    if loop is None and isinstance(script, str):
        return _assignment_in_file(script)
    try:
        function = inspect.unwrap(loop)   # type: ignore[arg-type]
        code = function.__code__
        source = inspect.getsource(function)
    except (AttributeError, TypeError, OSError, ValueError):
        return None
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        line = _assigns_lr(node)
        if line is not None:
            at = code.co_firstlineno + line - 1
            text = linecache.getline(code.co_filename, at).strip()
            return Location(code.co_filename, at, code.co_name, text or None)
    return None


def _assignment_in_file(path: str) -> Location | None:
    """The first line of a script that assigns a learning rate; None when it has none (the
    rate is set in a module it imports) or cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    lines = sorted(line for node in ast.walk(tree)
                   if (line := _assigns_lr(node)) is not None)
    if not lines:
        return None
    return Location(path, lines[0], None, linecache.getline(path, lines[0]).strip() or None)


def _assigns_lr(node: ast.AST) -> int | None:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    for target in targets:
        if (isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
                and target.slice.value == "lr"):
            return target.lineno
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update" and any(k.arg == "lr" for k in node.keywords)):
        return node.lineno
    return None
