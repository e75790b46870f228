"""What one run of the user's loop did (`Trace`): the probe's typed events and step records, and
how the run ended. The judge and the rules read a run only through this.

Also the loop casting the model's weights to reduced precision (`WeightCast`, seen by
`watching_casts`), and the error a reference run that did so raises (`WeightsCast`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import UserCodeError, exc_text
from . import recorder
from .callsite import CallSiteFinder, Site
from .events import Backward, E, MicroBatchFetched, Snapshot, of_type
from .observer import StepObserver

if TYPE_CHECKING:
    from ..loading import RunSettings


@dataclass(frozen=True)
class WeightCast:
    """The loop cast the model's weights to reduced precision (`model.half()`, `.bfloat16()`,
    `.to(torch.float16)`, `p.data = p.data.half()`): they were so when the loop returned."""

    dtypes: tuple[str, ...]          # the reduced-precision dtypes found, e.g. ("torch.float16",)
    names: tuple[str, ...]           # the parameters cast, in the model's order
    parameters: int                  # the model's trainable parameter tensors
    site: Site | None                # the call that cast them (a Module method), when seen


def _reduced(t: torch.Tensor) -> bool:
    """fp16, bf16, float8: the floating dtypes narrower than fp32."""
    return t.is_floating_point() and t.dtype.itemsize < 4


@contextlib.contextmanager
def watching_casts(model: torch.nn.Module, finder: CallSiteFinder,
                   seen: list[Site | None]) -> Iterator[None]:
    """Record where the loop casts `model`'s parameters to reduced precision through a Module
    method (`half`, `bfloat16`, `to`, `type` all go through `Module._apply`): the user's line
    of the last call that left a parameter narrower than fp32. torch's `_apply` is restored on
    any exit."""
    original = torch.nn.Module._apply
    params = [p for p in model.parameters() if p.requires_grad]
    depth = 0

    def _apply(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        nonlocal depth
        if depth:   # the children of the module the loop called it on
            return original(module, *args, **kwargs)
        before = [p.dtype for p in params]
        depth += 1
        try:
            return original(module, *args, **kwargs)
        finally:
            depth -= 1
            if any(p.dtype != d and _reduced(p) for p, d in zip(params, before, strict=True)):
                seen.append(finder.here())

    setattr(torch.nn.Module, "_apply", _apply)  # noqa: B010 - torch's method, replaced
    try:
        yield
    finally:
        setattr(torch.nn.Module, "_apply", original)  # noqa: B010


def weight_cast(model: torch.nn.Module, sites: list[Site | None]) -> WeightCast | None:
    """The trainable weights the loop left narrower than fp32 (build_model hands it fp32
    weights; a frozen part cast to bf16 to save memory is never updated)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cast = [(n, p) for n, p in named if _reduced(p)]
    if not cast:
        return None
    return WeightCast(tuple(sorted({str(p.dtype) for _, p in cast})), tuple(n for n, _ in cast),
                      len(named), sites[-1] if sites else None)


def handed_out_lazily(events: list[recorder.Event]) -> bool:
    """Were some micro-batches handed out after the first backward (the loop takes them as it
    goes), or is there no backward yet?"""
    first = next((e for e in events if isinstance(e, Backward)), None)
    if first is None:
        return True
    return any(isinstance(e, MicroBatchFetched) and e.seq > first.seq for e in events)


@dataclass
class Trace:
    """What one run of the user's loop did."""

    precision: str
    accumulation_steps: int
    probe: recorder.Probe
    settings: RunSettings
    error: BaseException | None = None
    error_site: Site | None = None
    error_time: float | None = None     # wall clock (time.time) when the loop raised
    optimizer_count: int = 1
    microbatches: int = 0
    stopped: bool = False               # ended early on purpose (`errors.EnoughSteps`)
    cast: WeightCast | None = None      # the loop left the weights in fp16/bf16

    @property
    def events(self) -> list[recorder.Event]:
        return self.probe.events

    @property
    def steps(self) -> list[recorder.StepRecord]:
        return self.probe.steps

    # --- what the probe saw, for the judge and the rules ----------------------------------
    @property
    def snapshots(self) -> dict[int, Snapshot]:
        """Per step group, the weights its steps saw (when the probe kept them)."""
        return self.probe.snapshots

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The run's optimizers, in slot order (the spec's, then any the loop built)."""
        return self.probe.optimizers

    @property
    def scalers(self) -> list[Any]:
        """The GradScalers the run used, in slot order."""
        return self.probe.scalers

    @property
    def model(self) -> torch.nn.Module | None:
        return self.probe.model

    @property
    def step_observer(self) -> StepObserver | None:
        """What saw the run's steps as they happened (the judge), if anything did."""
        return self.probe.step_observer

    @property
    def finder(self) -> CallSiteFinder:
        return self.probe.finder

    @property
    def random_site(self) -> Site | None:
        """Where the loop first drew random numbers outside the model's forward."""
        return self.probe.random_site

    @property
    def forward_matched(self) -> bool:
        """Was a forward matched to the micro-batch it read?"""
        return self.probe.forward_matched

    @property
    def backward_count(self) -> int:
        return self.probe.backward_count

    def parameter_names(self) -> dict[int, str]:
        """id(parameter) -> its name in the model, as the model is now."""
        model = self.probe.model
        return {id(p): n for n, p in model.named_parameters()} if model is not None else {}

    def parameter_owners(self) -> dict[int, int]:
        """id(parameter) -> the slot of the optimizer that holds it."""
        return {id(p): slot for slot, opt in enumerate(self.probe.optimizers)
                for group in opt.param_groups for p in group["params"]}

    def release_tensors(self) -> None:
        """Drop the per-step gradients and parameter snapshots (the bulk of a trace's memory,
        two copies of the model per step) once no rung will compare this trace again."""
        for step in self.probe.steps:
            step.grads = {}
        self.probe.snapshots.clear()

    def events_of(self, cls: type[E]) -> list[E]:
        """The run's events of type `cls`, in order."""
        return of_type(self.probe.events, cls)

    @property
    def microbatches_taken(self) -> int:
        """How many distinct micro-batches the loop took from `micro_batches`."""
        return len({e.index for e in self.events_of(MicroBatchFetched)})

    @property
    def lazy_feed(self) -> bool:
        """Did the loop take micro-batches as it went (some handed out after a backward), rather
        than all up front (`list(micro_batches)`)?"""
        return handed_out_lazily(self.probe.events)

    def window_of_event(self, event: recorder.Event | recorder.StepRecord) -> int | None:
        """The window an event belongs to, or None when the trace cannot tell.

        By the micro-batch last handed out when the loop takes them as it goes; for a loop that
        fetched them all up front, by backward calls when there is one per micro-batch (or one
        per window, a loop that sums the window's losses first).
        """
        K = self.accumulation_steps
        if isinstance(event, recorder.StepRecord) and event.consumed:
            return max(event.consumed) // K
        if self.probe.forward_matched or self.lazy_feed:
            # the micro-batch last forwarded (or, when forwards cannot be matched, fetched)
            return max(event.microbatch, 0) // K
        backwards = self.probe.backward_count
        if backwards == self.microbatches:
            return max(event.backwards - 1, 0) // K
        if K and backwards == self.microbatches // K:
            return max(event.backwards - 1, 0)
        return None

    def window_size(self, window: int) -> int | None:
        """The micro-batches of `window` where they may differ from K (a script's), else None."""
        return None

    def unstepped_window(self, before: int | None, window: int | None) -> int | None:
        """The first window between a step of window `before` and one of `window` that no step
        consumed and that holds fewer than K micro-batches (an epoch's last, short window the
        loop never stepped), where the trace knows its windows' sizes; None otherwise (a loop
        fed exactly N windows of K has none: a window without a step is a skipped one)."""
        return None


class WeightsCast(UserCodeError):
    """An fp32 run that ampdoctor needed as its reference cast the model's weights to reduced
    precision (`trace.cast`): no fp32 reference comes from it. The reproducibility rung hands
    the finding to fp32-accum (`half-open-amp`); anywhere else it ends the run (exit 3) with
    this message."""

    def __init__(self, trace: Trace):
        cast = trace.cast
        assert cast is not None
        site = cast.site
        at = f" at {site.file}:{site.line}" if site else ""
        dtype = cast.dtypes[0].removeprefix("torch.")
        raised = f"; it then raised {exc_text(trace.error, 300)}" if trace.error else ""
        super().__init__(
            f"the reference run (your train_loop in fp32) cast the model's weights to {dtype}"
            f"{at} ({len(cast.names)} of {cast.parameters} parameter tensors){raised}: no fp32 "
            "reference can come from it. Keep the model in fp32 in the loop and let autocast "
            "make the low-precision compute.",
            cause=trace.error, location=(site.file, site.line) if site else None)
        self.trace = trace
