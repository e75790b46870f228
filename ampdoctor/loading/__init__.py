"""Import the user's callables and build model, optimizer(s) and micro-batches from the spec.

A name that cannot be found is the spec's fault (SpecError, exit 2); user code that raises
while it is imported or called is the user's (UserCodeError, exit 3, with their file:line); a
model or data the triage cannot use is refused with the reason (InputError, exit 2).

- `usercode`: importing and calling the spec's callables (`UserCode`), forgetting them after
- `naming`: how messages name a spec key, its YAML line and a factory (`unusable`)
- `model`: building the model and optimizer(s), checking the model is usable
- `data`: cutting the data slice into micro-batches, checking them, describing them
- `loop`: the `run` settings, the device, and calling `train_loop`
"""

from .data import (
    check_finite,
    cut_micro_batches,
    merge_micro_batches,
    micro_batch_counts,
    micro_batch_size_of,
    to_device,
)
from .loop import AUTOCAST_DTYPES, RunSettings, resolve_device, run_train_loop
from .model import SHOWN_NAMES, build_model, build_optimizers, check_model
from .naming import defined_at, factory_name, spec_where, unusable
from .usercode import CALLED_WITH, UserCode, restore_recursion_limit

__all__ = [
    "AUTOCAST_DTYPES",
    "CALLED_WITH",
    "SHOWN_NAMES",
    "RunSettings",
    "UserCode",
    "build_model",
    "build_optimizers",
    "check_finite",
    "check_model",
    "cut_micro_batches",
    "defined_at",
    "factory_name",
    "merge_micro_batches",
    "micro_batch_counts",
    "micro_batch_size_of",
    "resolve_device",
    "restore_recursion_limit",
    "run_train_loop",
    "spec_where",
    "to_device",
    "unusable",
]
