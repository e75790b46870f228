"""One diagnose: the user's code loaded once, runs of their loop under the probe (`Trace`),
and the windows each step consumed. The reference gradients come from `reference`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import memory
from ..core.errors import AmpdoctorInterrupt, EnoughSteps, UserCodeError, exc_text
from ..loading import (
    AUTOCAST_DTYPES,
    RunSettings,
    UserCode,
    build_model,
    build_optimizers,
    factory_name,
    run_train_loop,
    to_device,
    unusable,
)
from ..loading.entrypoints import EntryPointRefused
from ..maths import compare, rng
from ..probe import recorder, spill
from ..probe.callsite import CallSiteFinder, Site
from ..probe.events import ScalerInit, ScalerStep, Update
from ..probe.observer import ProbeSettings, StepObserver
from ..probe.trace import Trace, WeightCast, WeightsCast, watching_casts, weight_cast
from ..reference import ReferenceBuilder
from ..spec import Spec
from .dtype_errors import data_dtype_culprit

#: Judge each step of the runs the rungs judge as it happens (`judge.StepJudge`); False: copy
#: every step's gradients and weights and judge after the run (the tests compare the two).
JUDGE_AS_IT_RUNS = True

__all__ = ["Session", "Distributed", "Trace", "WeightCast", "WeightsCast", "JUDGE_AS_IT_RUNS",
           "data_dtype_culprit", "flat"]


@dataclass
class _Run:
    """What one run of the loop is made of (`Session._prepare`)."""

    model: torch.nn.Module
    handed: Any                         # what the loop is handed (the model, or its DDP wrap)
    loop_optimizer: Any                 # what the loop is handed as its optimizer
    optimizers: list[torch.optim.Optimizer]
    feed: recorder.MicroBatchFeed
    aligner: recorder.ForwardAligner
    settings: RunSettings
    probe: recorder.Probe
    trace: Trace
    cast_sites: list[Site | None] = field(default_factory=list)


@dataclass(frozen=True)
class Distributed:
    """What a DDP rank's run of the loop gets instead of the session's plain one."""

    rank: int
    world_size: int
    shards: list[Any]                 # this rank's shard of every micro-batch, in order
    micro_batch_size: int | None
    wrap: Callable[[torch.nn.Module, recorder.Probe], Any]   # the model the loop is handed
    #: shards the model in place before its optimizer is built (FSDP2's fully_shard), or None
    shard: Callable[[torch.nn.Module], None] | None = None


class Session(ReferenceBuilder):
    def __init__(self, spec: Spec, code: UserCode, device: torch.device, finder: CallSiteFinder,
                 micro_batches: list[Any]):
        self.spec = spec
        self.code = code
        self.device = device
        self.finder = finder
        # Each micro-batch owns its storage, so a forward can be matched to the micro-batch it
        # consumed (recorder.MicroBatchIndex), whatever order the loop fetched them in.
        self.micro_batches = [_own_storage(to_device(mb, device)) for mb in micro_batches]
        self.batch_index = recorder.MicroBatchIndex(self.micro_batches)
        #: dropout: align -- the RNG seed of every micro-batch forward; off -- None
        self.align_seed: int | None = spec.seed if spec.dropout == "align" else None
        #: dropout: off -- every functional dropout at p = 0 in the loop's runs and the
        #: reference's forwards (`probe_settings`)
        self.dropout_off = spec.dropout == "off"
        self.K = spec.accumulation_steps
        self.N = spec.optimizer_steps
        self._ref_model: torch.nn.Module | None = None
        self.module_sites: dict[str, Site] = {}
        # (build_model refuses a model the triage cannot use: exit 2, naming the reason)
        self._template = self._build_template()
        self.param_shapes = {n: p.shape for n, p in self._template.named_parameters()}
        self.param_order = [n for n, _ in self._template.named_parameters()]
        # The template is never trained: its own tensors are the initial state (no copy).
        self.initial_state = {k: v.detach() for k, v in self._template.state_dict().items()}
        self.traces: dict[str, Trace] = {}
        #: per-run chart series for the record (`ladder.series`): scalars only
        self.charts: list[dict[str, Any]] = []
        #: Caveats about how the reference was built, shown in the record.
        self.notes: set[str] = set()
        #: Micro-batches of different shapes without a `loss`: how the loop weighs them, a key
        #: of `micro_batch_counts` (None: equally, a guess until the judge finds otherwise).
        self.loop_weighting: str | None = None
        #: The loss scale every fp16 run starts from when the loop's own init_scale overflowed
        #: every step of the slice (`_past_scale_search`), else None: the loop's own.
        self.fp16_start_scale: float | None = None
        #: Makes the observer that judges a run's steps as they happen, from (session, trace,
        #: precision); set by the rung driver (`ladder.run_ladder`). None: every run is
        #: judged after it ended.
        self.step_observer_for: Callable[[Session, Trace, str], StepObserver] | None = None
        #: The fp16 run with an injected overflow (`ladder.skips.InjectedRun`), once run:
        #: clip-space may run it (with clipping forced) for skips.
        self.injected: Any = None

    def _build_template(self) -> torch.nn.Module:
        """Build the model once while recording where each submodule was constructed, so a
        finding about a layer (dropout) can point at the user's line."""
        created: list[tuple[torch.nn.Module, Site | None]] = []
        original = torch.nn.Module.__init__
        finder = self.finder

        def __init__(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            created.append((module, finder.here()))

        setattr(torch.nn.Module, "__init__", __init__)  # noqa: B010 - torch's method, replaced
        try:
            with recorder.observing(self.probe_settings()):
                model = build_model(self.code, self.device, self.spec.seed)
        finally:
            setattr(torch.nn.Module, "__init__", original)  # noqa: B010
        sites = {id(m): site for m, site in created}
        for name, module in model.named_modules():
            site = sites.get(id(module))
            if site is not None:
                self.module_sites[name or "(model)"] = site
        return model

    # --- running the loop --------------------------------------------------------------
    def settings(self, precision: str, K: int | None = None,
                 max_grad_norm: float | None | str = "spec",
                 steps: int | None = None) -> RunSettings:
        return RunSettings(
            precision=precision, device=self.device, device_type=self.device.type,
            autocast_dtype=AUTOCAST_DTYPES[precision],
            accumulation_steps=K or self.K,
            max_grad_norm=(self.spec.max_grad_norm if isinstance(max_grad_norm, str)
                           else max_grad_norm),   # "spec": the spec's
            rank=0, world_size=1, micro_batch_size=self.spec.micro_batch_size,
            optimizer_steps=steps or self.N)

    def probe_settings(self, precision: str | None = None) -> ProbeSettings:
        """The settings the probe's patches follow in a run of `precision` (None: a reference)."""
        return ProbeSettings(dropout_off=self.dropout_off,
                             start_scale=self.fp16_start_scale if precision == "fp16" else None)

    def run_loop(self, precision: str, *, micro_batches: list[Any] | None = None,
                 K: int | None = None, state: Mapping[str, torch.Tensor] | None = None,
                 training: bool = True, max_grad_norm: float | None | str = "spec",
                 rng_seed: int | None = None, capture: bool = True,
                 before_backward: Callable[[recorder.Probe, torch.Tensor], None] | None = None,
                 distributed: Distributed | None = None,
                 step_sink: Callable[[recorder.StepRecord], Any] | None = None,
                 judge_as_it_runs: str | None = None) -> Trace:
        """One run of the user's loop under the probe.

        `distributed`: a DDP rank's run -- the micro-batches are this rank's shards (in the
        order of the session's micro-batches, so a shard's position is its micro-batch's index),
        the model is handed to the loop through `distributed.wrap`, and `run` says the rank.

        `judge_as_it_runs`: the precision this run will be judged at; each step is then judged
        as it happens (the observer `step_observer_for` makes) where it can be, instead of
        copied for after the run.
        """
        with recorder.observing(self.probe_settings(precision)):
            run = self._prepare(precision, micro_batches, K, state, training, max_grad_norm,
                                distributed)
            probe, trace = run.probe, run.trace
            probe.capture_grads = capture
            probe.before_backward = before_backward
            probe.step_sink = step_sink
            probe.on_frozen = recorder.Shared(self.loop_froze)
            # (a reduced-precision run is judged with the fp32 run's clip thresholds: as it
            # runs only once that run exists, as with the whole ladder)
            if (judge_as_it_runs is not None and JUDGE_AS_IT_RUNS
                    and self.step_observer_for is not None and self.code.loss is not None
                    and distributed is None and state is None and micro_batches is None
                    and K is None and capture and step_sink is None and len(run.optimizers) == 1
                    and (judge_as_it_runs == "fp32" or "fp32" in self.traces)):
                probe.step_observer = self.step_observer_for(self, trace, judge_as_it_runs)
            if rng_seed is not None:
                rng.manual_seed(rng_seed)
            default_dtype, changed = self._execute(run)
        trace.cast = weight_cast(run.model, run.cast_sites)
        if trace.error is not None and precision == "fp32" and trace.cast is None:
            site = trace.error_site
            self._refuse_data_dtype(trace.error, (site.file, site.line) if site else None,
                                    "the fp32 run of your loop")
        # a DDP rank compares its final parameters with the other ranks'
        self._drop_training_state(trace, parameters=distributed is None)
        memory.trim()
        if changed != default_dtype and trace.error is None:
            raise UserCodeError(
                f"the loop changed torch's default dtype from {default_dtype} to {changed} "
                "(torch.set_default_dtype) in its " + precision + " run: every later run and "
                "the reference would build their tensors in another dtype. Set the dtype on the "
                "model or the tensors instead; ampdoctor restored it.")
        return trace

    def _prepare(self, precision: str, micro_batches: list[Any] | None, K: int | None,
                 state: Mapping[str, torch.Tensor] | None, training: bool,
                 max_grad_norm: float | None | str, distributed: Distributed | None) -> _Run:
        """The model, optimizers, feed and probe of one run, and its (still empty) trace."""
        model = build_model(self.code, self.device, self.spec.seed)
        if state is not None:
            model.load_state_dict({k: v.to(self.device) for k, v in state.items()})
            model.train(training)
        if distributed is not None and distributed.shard is not None:
            distributed.shard(model)   # FSDP: the optimizer must see the sharded parameters
        loop_optimizer, optimizers = build_optimizers(self.code, model)
        mbs = self.micro_batches if micro_batches is None else micro_batches
        settings = self.settings(precision, K, max_grad_norm, steps=len(mbs) // (K or self.K) or 1)
        probe = recorder.Probe(self.finder, model, optimizers)
        if state is None and distributed is None:
            probe.initial_state = self.initial_state
        batch_index = self.batch_index
        handed: Any = model
        if distributed is not None:
            mbs = distributed.shards
            batch_index = recorder.MicroBatchIndex(mbs)
            indices = list(range(len(mbs)))
            settings = dataclasses.replace(settings, rank=distributed.rank,
                                           world_size=distributed.world_size,
                                           micro_batch_size=distributed.micro_batch_size,
                                           optimizer_steps=self.N)
            handed = distributed.wrap(model, probe)
        else:
            indices = [self.index_of(mb, position) for position, mb in enumerate(mbs)]
        feed = recorder.MicroBatchFeed(mbs, probe, indices)
        aligner = recorder.ForwardAligner(batch_index, self.align_seed, probe.on_forward)
        aligner.fallback = lambda: probe.fetched if probe.fetched >= 0 else None
        aligner.attach(model)
        probe.aligner = aligner
        trace = Trace(precision, settings.accumulation_steps, probe, settings,
                      optimizer_count=len(optimizers), microbatches=len(mbs))
        return _Run(model, handed, loop_optimizer, optimizers, feed, aligner, settings, probe,
                    trace)

    def _execute(self, run: _Run) -> tuple[torch.dtype, torch.dtype]:
        """Run the loop with its probe recording; whatever it raises is recorded on the trace
        (Ctrl-C and ampdoctor's own interruptions go past). The default dtype before the run
        and as the loop left it (restored)."""
        trace, probe = run.trace, run.probe
        previous = recorder.activate(probe)
        default_dtype = torch.get_default_dtype()
        try:
            with watching_casts(run.model, self.finder, run.cast_sites):
                generator = run_train_loop(self.code, run.handed, run.loop_optimizer, run.feed,
                                           run.settings)
            if generator:
                self.notes.add("train_loop is a generator function: ampdoctor runs it by "
                               "iterating it to the end")
        except BaseException as exc:
            # The user's loop raised (anything, sys.exit included): recorded, judged by the
            # rung. Only Ctrl-C and ampdoctor's own interruptions go past.
            if isinstance(exc, (KeyboardInterrupt, AmpdoctorInterrupt, EntryPointRefused)):
                raise    # (the last: what a spec's entry point returned, exit 2)
            if isinstance(exc, EnoughSteps):
                trace.stopped = True
            else:
                trace.error = exc
                trace.error_time = time.time()
                trace.error_site = self.finder.from_traceback(exc.__traceback__)
        finally:
            recorder.activate(previous)
            if probe.step_observer is not None:
                probe.step_observer.finish()
            run.aligner.detach()
            changed = torch.get_default_dtype()
            torch.set_default_dtype(default_dtype)   # never left changed for the next run
        return default_dtype, changed

    def _refuse_data_dtype(self, exc: BaseException, at: tuple[str, int] | None,
                           what: str) -> None:
        """The data factory returned a field in a dtype the user's code cannot take (integers
        where a float is needed, float64 for a float32 model), and an fp32 run of the user's code
        raised on it: exit 2 naming the data factory, the field and the line, not a loop error.
        Integer fields are fine as such (token ids, labels): only the error torch raised, naming
        that field's dtype, blames one."""
        culprit = data_dtype_culprit(exc, self.micro_batches)
        if culprit is None:
            return
        field, tensor = culprit
        where = f" at {at[0]}:{at[1]}" if at else ""
        advice = ("Integer and bool tensors are fine as token ids, labels and masks, but this "
                  "one feeds a float computation: return it as a float tensor from the factory "
                  "(or convert it in the loop)"
                  if not (tensor.is_floating_point() or tensor.is_complex()) else
                  "Return it as float32: ampdoctor builds the model in float32, and autocast "
                  "makes the low-precision compute")
        raise unusable(self.spec, "data", (
            f"{factory_name(self.spec, 'data', self.code.data_factory)} returns {field} of each "
            f"micro-batch as {tensor.dtype} (shape {tuple(tensor.shape)}) and your code cannot "
            f"compute with it: {what} raised{where}: {exc_text(exc, 500)}. {advice}."),
            cause=exc)

    def index_of(self, mb: Any, default: int) -> int:
        """The session-wide index of a micro-batch ampdoctor handed out (by storage)."""
        found = self.batch_index.find(mb, None)
        return default if found is None else found

    #: The last rung that compares each plain trace's gradients step by step.
    _LAST_USE = {"fp32-accum": "fp32", "bf16-no-scaler": "bf16", "fp16-scaler": "fp16"}

    def rung_done(self, rung_id: str) -> None:
        """Free what no later rung needs (a 20M-parameter model keeps ~160 MB per step)."""
        spill.forget_cache()
        precision = self._LAST_USE.get(rung_id)
        done = [self.traces[precision]] if precision in self.traces else []
        if rung_id == "clip-space" and self.injected is not None:
            done.append(self.injected.trace)   # skips reads its events only
        for trace in done:   # the run's model was freed when its loop returned
            trace.release_tensors()
        memory.trim()

    def _drop_training_state(self, trace: Trace, parameters: bool) -> None:
        """Free what a run's model holds once its loop returned, none of it read again: its
        optimizer state (AdamW: two copies of the model) and gradients (the steps keep their
        own copies); with `parameters`, their storage too (the judge reads only their names
        and identities: the tensors stay). Storage the template, the initial state or the
        reference model also use is never freed."""
        model = trace.model
        if model is None or model is self._template or model is self._ref_model:
            return
        for opt in trace.optimizers:
            opt.state.clear()
        for p in model.parameters():
            p.grad = None
        if not parameters:
            return
        kept = {t.untyped_storage().data_ptr() for t in self.initial_state.values()}
        if self._ref_model is not None:
            kept |= {t.untyped_storage().data_ptr() for t in self._ref_model.state_dict().values()}
        for t in model.state_dict().values():
            storage = t.untyped_storage()
            if storage.data_ptr() not in kept and storage.nbytes() and type(t) is torch.Tensor:
                storage.resize_(0)

    def trace(self, precision: str) -> Trace:
        """The plain run of a precision, run once and cached."""
        if precision not in self.traces:
            trace = self.run_loop(precision, rng_seed=self.spec.seed + 1,
                                  judge_as_it_runs=precision)
            if precision == "fp16":
                trace = self._past_scale_search(trace)
            self.traces[precision] = trace
        return self.traces[precision]

    #: At most this many reruns of the fp16 slice from a lower start scale.
    SCALE_SEARCH_RUNS = 3

    def _past_scale_search(self, trace: Trace) -> Trace:
        """Start the fp16 runs where the scaler's own search ends, when it never ends in the slice.

        A GradScaler starts high (65536 by default) and halves on each overflow until the
        gradients fit: a few skipped steps at the start of training, which a slice of a few
        optimizer steps may never get past. Then no update can be compared, and a bug would pass
        unseen. So when every step of the plain run was skipped, rerun it from the scale the
        search reached (the scale after its last update), at most SCALE_SEARCH_RUNS times.
        Only the start scale changes: backoff, growth and the loop's code stay its own.
        """
        first = trace
        for _ in range(self.SCALE_SEARCH_RUNS):
            steps = trace.events_of(ScalerStep)
            scales = [e.scale_after for e in trace.events_of(Update) if e.scale_after]
            if (trace.error is not None or not steps or not all(e.skipped for e in steps)
                    or not scales or not any(e.enabled for e in trace.events_of(ScalerInit))):
                break
            self.fp16_start_scale = scales[-1]
            trace = self.run_loop("fp16", rng_seed=self.spec.seed + 1, judge_as_it_runs="fp16")
        if trace is not first:
            loop_init = next(e.init_scale for e in first.events_of(ScalerInit) if e.enabled)
            applied = any(not e.skipped for e in trace.events_of(ScalerStep))
            self.notes.add(
                f"the loop's init_scale {loop_init:g} overflowed all "
                f"{len(first.events_of(ScalerStep))} steps of the slice (the scaler's start-up "
                f"search): the fp16 runs start from {self.fp16_start_scale:g}"
                + ("" if applied else ", where every step still overflowed"))
        return trace

    # --- windows ------------------------------------------------------------------------
    def window(self, index: int) -> list[Any]:
        return self.micro_batches[index * self.K:(index + 1) * self.K]

    def window_of(self, step: recorder.StepRecord | recorder.Event, ordinal: int = 0,
                  trace: Trace | None = None) -> int:
        """Which window an event (or step) belongs to.

        See `Trace.window_of_event`; where the trace cannot tell, the step's ordinal.
        """
        window = (max(step.microbatch, 0) // self.K if trace is None
                  else trace.window_of_event(step))
        if window is None:
            window = ordinal
        return max(0, min(window, self.N - 1))

def _own_storage(mb: Any) -> Any:
    """Each tensor of a micro-batch copied into storage of its own, as a leaf: no autograd
    graph back into the data factory (a slice computed from a tensor that requires grad would
    have every micro-batch backward through one shared graph), `requires_grad` as given."""
    def own(t: torch.Tensor) -> torch.Tensor:
        copy = t.detach().clone()
        return copy.requires_grad_() if t.requires_grad and copy.is_floating_point() else copy

    if isinstance(mb, dict):
        return {k: own(v) for k, v in mb.items()}
    return tuple(own(t) for t in mb)


def flat(session: Session, grads: Mapping[str, torch.Tensor | None],
         names: list[str]) -> torch.Tensor:
    return compare.flatten(grads, names, session.param_shapes)
