"""The kind of a loop that raised or hung: `loop-error`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from ..enums import KindId
from ..findings import Finding
from .base import Kind, Observed

LOOP_ERROR = Kind(
    KindId.LOOP_ERROR,
    title="The training loop raised an error",
    why=(
        "The loop raised an exception ampdoctor does not recognise as one of the known mistakes "
        "(or hung past `timeout_s`, or a DDP rank raised or hung)."),
    fix=(
        "Fix the error at the reported line (`evidence.loop_line` is the loop's own line that "
        "called it; `--debug` prints the full traceback); run the loop alone on the same slice to "
        "reproduce it. For a timeout that is only slowness, raise `timeout_s` in the spec."),
    example=(
        "for x, y in micro_batches:\n"
        "    with torch.autocast(run.device_type, dtype=run.autocast_dtype,\n"
        "                        enabled=run.autocast_dtype is not None):\n"
        "        x = torch.cat([x[:, :-1], torch.ones(len(x), 2)], 1)  # wrong width\n"
        "        loss = criterion(model(x), y) / K"),
    error_when="the loop raised or hung: nothing after it can be judged (exit 3).",
    measured="the exception the loop raised",
    decided_in=f"{__name__}:loop_error",
)


def loop_error(seen: Observed) -> Finding:
    """`loop-error`: the training loop raised an error.
    Error: the loop raised or hung (exit 3). (`LOOP_ERROR.error_when`)"""
    return Finding(seen.rung, KindId.LOOP_ERROR, seen.severity, **seen.fields(LOOP_ERROR))
