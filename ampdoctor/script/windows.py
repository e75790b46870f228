"""The reference's windows in a script run's micro-batches: the run's forwards walked against
the reference run's (K = 1, a batch of K x b rows), window by window. K micro-batches each, but
fewer in an epoch's last, short window, which moves every window after it off `i // K`."""

from __future__ import annotations

from typing import Any


def align(run: list[Any], ref: list[Any], N: int) -> tuple[str | None, tuple[int, ...] | None]:
    """Why the reference's windows do not read the run's micro-batches (None when every window
    does, row by row, every tensor argument of the forwards), and where each of the reference's
    windows ends in the run's micro-batches (exclusive; None when none could be told)."""
    start = 0
    ends: list[int] = []
    for window in range(N):
        theirs = [f for f in ref if f.window == window]
        rows_ref = sum(f.rows for f in theirs)
        # the run's next forwards up to the reference window's rows: K micro-batches, or
        # fewer in an epoch's last, partial window
        end, rows_mine = start, 0
        while end < len(run) and rows_mine < rows_ref:
            rows_mine += run[end].rows
            end += 1
        mine, start = run[start:end], end
        if not mine or not theirs:
            break
        if rows_mine != rows_ref or _concat(mine) != _concat(theirs):
            return (f"window {window}: the reference read {rows_ref} row(s) in "
                    f"{len(theirs)} forward(s), the run {rows_mine} in {len(mine)} "
                    f"micro-batch(es) of {mine[0].rows}, and their contents differ"), None
        ends.append(end)
    return None, tuple(ends) or None


def _concat(forwards: list[Any]) -> list[list[str]]:
    """The row digests of consecutive forwards, tensor argument by tensor argument."""
    width = min(len(f.digests) for f in forwards)
    return [[d for f in forwards for d in f.digests[i]] for i in range(width)]
