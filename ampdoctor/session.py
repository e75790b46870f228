"""One diagnose: the user's code loaded once, runs of their loop under the probe, and the
teacher-forced fp32 reference gradients (DESIGN §1), cached per window and parameter state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from . import compare
from .errors import UserCodeError
from .loading import (AUTOCAST_DTYPES, RunSettings, UserCode, build_model, build_optimizers,
                      merge_micro_batches, micro_batch_counts, micro_batch_size_of,
                      run_train_loop, to_device)
from .probe import recorder
from .probe.callsite import CallSiteFinder, Site
from .spec import Spec

RANDOM_MODULE_TYPES = (
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout",
    "RReLU",
)


@dataclass
class Trace:
    """What one run of the user's loop did."""

    precision: str
    accumulation_steps: int
    probe: recorder.Probe
    settings: RunSettings
    error: BaseException | None = None
    error_site: Site | None = None
    optimizer_count: int = 1
    microbatches: int = 0

    @property
    def events(self) -> list[recorder.Event]:
        return self.probe.events

    @property
    def steps(self) -> list[recorder.StepRecord]:
        return self.probe.steps

    def release_tensors(self) -> None:
        """Drop the per-step gradients and parameter snapshots (the bulk of a trace's memory,
        two copies of the model per step) once no rung will compare this trace again."""
        for step in self.probe.steps:
            step.grads = {}
        self.probe.snapshots.clear()

    @property
    def microbatches_taken(self) -> int:
        """How many distinct micro-batches the loop took from `micro_batches`."""
        return len({e.data.get("index") for e in self.probe.events if e.kind == "microbatch"})

    @property
    def lazy_feed(self) -> bool:
        """Did the loop take micro-batches as it went (some handed out after a backward), rather
        than all up front (`list(micro_batches)`)?"""
        events = self.probe.events
        first = next((e for e in events if e.kind == "backward"), None)
        if first is None:
            return True
        return any(e.kind == "microbatch" and e.seq > first.seq for e in events)

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

    def of_kind(self, *kinds: str) -> list[recorder.Event]:
        return [e for e in self.probe.events if e.kind in kinds]


@dataclass
class WindowReference:
    """The fp32 reference of one window at one parameter state."""

    full: dict[str, torch.Tensor | None]        # unclipped step gradient
    per_mb: list[dict[str, torch.Tensor | None]] | None
    counts: list[float] | None
    weighted: bool
    mode: str                                   # "loss" or "loop"


class Session:
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
        recorder.DROPOUT_OFF = spec.dropout == "off"
        self.K = spec.accumulation_steps
        self.N = spec.optimizer_steps
        self._ref_model: torch.nn.Module | None = None
        self.module_sites: dict[str, Site] = {}
        self._template = self._build_template()
        if not any(p.requires_grad for p in self._template.parameters()):
            raise UserCodeError(f"the model factory '{spec.model}' built a model with no "
                                "trainable parameters: there is nothing to optimize.")
        self.param_shapes = {n: p.shape for n, p in self._template.named_parameters()}
        self.param_order = [n for n, _ in self._template.named_parameters()]
        self.initial_state = {k: v.detach().clone() for k, v in self._template.state_dict().items()}
        self.traces: dict[str, Trace] = {}
        #: Caveats about how the reference was built, shown in the record.
        self.notes: set[str] = set()
        #: Micro-batches of different shapes without a `loss`: how the loop weighs them, a key
        #: of `micro_batch_counts` (None: equally), and whether the fp32 run has been asked.
        self.loop_weighting: str | None = None
        self.weighting_open = False

    def _build_template(self) -> torch.nn.Module:
        """Build the model once while recording where each submodule was constructed, so a
        finding about a layer (dropout) can point at the user's line."""
        created: list[tuple[torch.nn.Module, Site | None]] = []
        original = torch.nn.Module.__init__
        finder = self.finder

        def __init__(module, *args, **kwargs):
            original(module, *args, **kwargs)
            created.append((module, finder.here()))

        torch.nn.Module.__init__ = __init__
        try:
            model = build_model(self.code, self.device, self.spec.seed)
        finally:
            torch.nn.Module.__init__ = original
        sites = {id(m): site for m, site in created}
        for name, module in model.named_modules():
            site = sites.get(id(module))
            if site is not None:
                self.module_sites[name or "(model)"] = site
        return model

    # --- running the loop --------------------------------------------------------------
    def settings(self, precision: str, K: int | None = None,
                 max_grad_norm: float | None | str = "spec", steps: int | None = None) -> RunSettings:
        return RunSettings(
            precision=precision, device=self.device, device_type=self.device.type,
            autocast_dtype=AUTOCAST_DTYPES[precision],
            accumulation_steps=K or self.K,
            max_grad_norm=self.spec.max_grad_norm if max_grad_norm == "spec" else max_grad_norm,
            rank=0, world_size=1, micro_batch_size=self.spec.micro_batch_size,
            optimizer_steps=steps or self.N)

    def run_loop(self, precision: str, *, micro_batches: list[Any] | None = None,
                 K: int | None = None, state: dict[str, torch.Tensor] | None = None,
                 training: bool = True, max_grad_norm: float | None | str = "spec",
                 rng_seed: int | None = None, capture: bool = True,
                 before_backward=None) -> Trace:
        model = build_model(self.code, self.device, self.spec.seed)
        if state is not None:
            model.load_state_dict({k: v.to(self.device) for k, v in state.items()})
            model.train(training)
        loop_optimizer, flat = build_optimizers(self.code, model)
        mbs = self.micro_batches if micro_batches is None else micro_batches
        settings = self.settings(precision, K, max_grad_norm, steps=len(mbs) // (K or self.K) or 1)
        probe = recorder.Probe(self.finder, model, flat)
        probe.capture_grads = capture
        probe.before_backward = before_backward
        indices = [self.index_of(mb, position) for position, mb in enumerate(mbs)]
        feed = recorder.MicroBatchFeed(mbs, probe, indices)
        aligner = recorder.ForwardAligner(self.batch_index, self.align_seed, probe.on_forward)
        aligner.fallback = lambda: probe.fetched if probe.fetched >= 0 else None
        aligner.attach(model)
        probe.aligner = aligner
        trace = Trace(precision, settings.accumulation_steps, probe, settings,
                      optimizer_count=len(flat), microbatches=len(mbs))
        if rng_seed is not None:
            torch.manual_seed(rng_seed)
        previous = recorder.activate(probe)
        try:
            if run_train_loop(self.code, model, loop_optimizer, feed, settings):
                self.notes.add("train_loop is a generator function: ampdoctor runs it by "
                               "iterating it to the end")
        except Exception as exc:  # the user's loop raised: recorded, judged by the rung
            trace.error = exc
            trace.error_site = self.finder.from_traceback(exc.__traceback__)
        finally:
            recorder.activate(previous)
            aligner.detach()
        return trace

    def index_of(self, mb: Any, default: int) -> int:
        """The session-wide index of a micro-batch ampdoctor handed out (by storage)."""
        found = self.batch_index.find(mb, None)
        return default if found is None else found

    #: The last rung that compares each plain trace's gradients step by step.
    _LAST_USE = {"fp32-accum": "fp32", "bf16-no-scaler": "bf16", "fp16-scaler": "fp16"}

    def rung_done(self, rung_id: str) -> None:
        """Free what no later rung needs (a 20M-parameter model keeps ~160 MB per step)."""
        precision = self._LAST_USE.get(rung_id)
        if precision in self.traces:
            self.traces[precision].release_tensors()

    def trace(self, precision: str) -> Trace:
        """The plain run of a precision, run once and cached."""
        if precision not in self.traces:
            self.traces[precision] = self.run_loop(precision, rng_seed=self.spec.seed + 1)
        return self.traces[precision]

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

    # --- the reference ----------------------------------------------------------------
    def random_modules(self) -> list[str]:
        found = []
        for name, module in self._template.named_modules():
            cls = type(module).__name__
            if cls in RANDOM_MODULE_TYPES and module.training:
                p = getattr(module, "p", getattr(module, "lower", None))
                if cls.startswith("Dropout") or "Dropout" in cls:
                    if not p:
                        continue
                found.append(f"{name or '(model)'} ({cls}{f', p={p}' if p is not None else ''})")
        return found

    def has_batch_statistics(self) -> bool:
        return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
                   for m in self._template.modules())

    def _model_at(self, state: dict[str, torch.Tensor], training: bool) -> torch.nn.Module:
        if self._ref_model is None:
            self._ref_model = build_model(self.code, self.device, self.spec.seed)
            recorder.ForwardAligner(self.batch_index, self.align_seed).attach(self._ref_model)
        model = self._ref_model
        model.load_state_dict({k: v.to(self.device) for k, v in state.items()})
        model.train(training)
        return model

    def _grads_of(self, model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else p.grad.detach().to("cpu", torch.float32, copy=True)
                for n, p in model.named_parameters()}

    def reference(self, window: int, state: dict[str, torch.Tensor] | None = None,
                  training: bool = True, rng_seed: int | None = None,
                  per_mb: bool = True) -> WindowReference:
        return self.reference_for(self.window(window), state, training, rng_seed, per_mb,
                                  label=f"window {window}")

    def reference_for(self, mbs: list[Any], state: dict[str, torch.Tensor] | None = None,
                      training: bool = True, rng_seed: int | None = None, per_mb: bool = True,
                      label: str = "window") -> WindowReference:
        """The fp32 reference gradient of one optimizer step over `mbs` at `state`."""
        state = self.initial_state if state is None else state
        previous = recorder.activate(None)
        try:
            if rng_seed is not None:
                torch.manual_seed(rng_seed)
            if self.code.loss is not None:
                ref = self._reference_from_loss(mbs, state, training, per_mb)
            else:
                ref = self._reference_from_loop(mbs, state, training, per_mb)
            return self._check_finite(ref, label)
        finally:
            recorder.activate(previous)

    def _check_finite(self, ref: WindowReference, window: str) -> WindowReference:
        bad = [n for n, g in ref.full.items() if g is not None and not bool(torch.isfinite(g).all())]
        if bad:
            raise UserCodeError(
                f"the fp32 reference gradient of {window} is not finite (parameter "
                f"{bad[0]}): the baseline itself diverges, so no comparison means anything. Check "
                "the data slice and the loss.")
        return ref

    def _reference_from_loss(self, mbs, state, training, per_mb: bool = True) -> WindowReference:
        """The reference from the spec's `loss`: the mean of the micro-batch losses' gradients,
        or, for `(loss_sum, weight_sum)`, the sum of the loss sums' gradients over the sum of
        the weights. Without `per_mb`, autograd accumulates the window in .grad (one copy of
        the gradients instead of K)."""
        model = self._model_at(state, training)
        per: list[dict[str, torch.Tensor | None]] = []
        counts: list[float] = []
        weighted = False
        model.zero_grad(set_to_none=True)
        for index, mb in enumerate(mbs):
            if per_mb:
                model.zero_grad(set_to_none=True)
            out = self.code.call("the loss function", self.code.loss, model, mb)
            if isinstance(out, (tuple, list)) and len(out) == 2:
                weighted = True
                loss_sum, weight = out
                weight = float(weight.detach()) if isinstance(weight, torch.Tensor) else float(weight)
                if weight <= 0:
                    raise UserCodeError(f"the loss function returned a weight of {weight} for "
                                        f"micro-batch {index}; weights must be positive.")
                loss = loss_sum
            elif isinstance(out, torch.Tensor) and out.numel() == 1:
                loss, weight = out, float(micro_batch_size_of(mb))
            else:
                raise UserCodeError("the loss function must return a scalar tensor or a pair "
                                    f"(loss_sum, weight_sum); it returned {type(out).__name__}.")
            if not torch.isfinite(loss.detach()).all():
                raise UserCodeError(f"the fp32 reference loss is not finite on micro-batch "
                                    f"{index} ({float(loss.detach())}); the baseline itself "
                                    "diverges, so nothing can be compared.")
            self.code.call("backward through the loss function", loss.backward)
            if per_mb:
                per.append(self._grads_of(model))
            counts.append(weight)
        if per_mb:
            # per micro-batch: the mean (weighted: loss_sum / weight) of each one
            sums = per
            if weighted:
                per = [_scale(g, 1.0 / w) for g, w in zip(sums, counts)]
                full = _combine(sums, [1.0 / sum(counts)] * len(sums))
            else:
                full = _combine(per, [1.0 / len(per)] * len(per))
        else:
            full = self._grads_of(model)
            factor = 1.0 / (sum(counts) if weighted else len(mbs))
            for g in full.values():
                if g is not None:
                    g.mul_(factor)
        model.zero_grad(set_to_none=True)
        return WindowReference(full, per if per_mb else None, counts, weighted, "loss")

    def loop_gradient(self, mbs: list[Any], state, training, K: int = 1) -> dict[str, torch.Tensor | None]:
        """Run the user's loop in fp32 from `state` on `mbs` and return the first step's
        gradients (all optimizers), before clipping."""
        no_clip = math.inf if self.spec.max_grad_norm is not None else None
        trace = self.run_loop("fp32", micro_batches=mbs, K=K, state=state, training=training,
                              max_grad_norm=no_clip)
        if trace.error is not None:
            site = trace.error_site
            where = f" at {site.file}:{site.line}" if site else ""
            raise UserCodeError(
                "the reference run (your train_loop in fp32 with K = 1 on one micro-batch holding "
                f"the whole step's data) raised{where}: {type(trace.error).__name__}: "
                f"{trace.error}. Give the spec a `loss` callable to use ampdoctor's own reference.",
                cause=trace.error, location=(site.file, site.line) if site else None)
        if not trace.steps:
            raise UserCodeError(
                "the reference run (your train_loop in fp32 with K = 1) never called "
                "optimizer.step(), so there is no reference gradient. Give the spec a `loss` "
                "callable to use ampdoctor's own reference.")
        first_group = trace.steps[0].group
        grads: dict[str, torch.Tensor | None] = {}
        for step in trace.steps:
            if step.group == first_group:
                grads.update(step.grads)
        return {n: grads.get(n) for n in self.param_order}

    def _reference_from_loop(self, mbs, state, training, per_mb: bool) -> WindowReference:
        batch_stats = self.has_batch_statistics()
        # Aligned dropout draws its masks per micro-batch: one batch of the whole window would
        # draw others, so the reference combines per-micro-batch runs, as for BatchNorm.
        aligned = self.align_seed is not None and bool(self.random_modules())
        per = None
        if per_mb or batch_stats or aligned:
            per = [self.loop_gradient([mb], state, training) for mb in mbs]
        if batch_stats or aligned:
            # BatchNorm normalises per micro-batch: the full-batch gradient is not what a correct
            # accumulation computes, the mean (or, for a loss that sums over samples, the sum) of
            # the micro-batch gradients is. Which of the two the loss does, the full-batch run
            # still tells: it is far closer to one than to the other (a factor K apart).
            mean = _combine(per, [1.0 / len(per)] * len(per))
            total = _combine(per, [1.0] * len(per))
            merged = merge_micro_batches(mbs)
            full = mean
            if merged is not None:
                whole = self.loop_gradient([merged], state, training)
                if _distance(whole, total) < _distance(whole, mean):
                    full = total
            self.notes.add("the model normalises over the batch (BatchNorm): the loop-as-reference "
                           "combines per-micro-batch gradients" if batch_stats else
                           "the model has dropout, aligned per micro-batch: the "
                           "loop-as-reference combines per-micro-batch gradients")
        else:
            merged = merge_micro_batches(mbs)
            if merged is None:
                # Micro-batches of different shapes cannot form one batch: the reference falls
                # back to the equal-weight mean of per-micro-batch gradients (a token-weighted
                # mismatch then needs a `loss` in the spec to be seen).
                per = per or [self.loop_gradient([mb], state, training) for mb in mbs]
                full = _combine(per, self.fallback_weights(mbs))
                if self.loop_weighting is None:
                    self.weighting_open = True
                    self.notes.add("micro-batches differ in shape: the loop-as-reference is the "
                                   "equal-weight mean of per-micro-batch gradients (give the "
                                   "spec a `loss` to state the weighting)")
            else:
                full = self.loop_gradient([merged], state, training)
        counts = [float(micro_batch_size_of(mb)) for mb in mbs]
        return WindowReference(full, per, counts, False, "loop")

    def fallback_weights(self, mbs: list[Any], what: str | None = "loop") -> list[float]:
        """Per-micro-batch weights (summing to 1) of the loop-as-reference for micro-batches
        that cannot be concatenated: equal, or proportional to the count the loop weighs by."""
        what = self.loop_weighting if what == "loop" else what
        if what is None:
            return [1.0 / len(mbs)] * len(mbs)
        counts = [micro_batch_counts(mb).get(what, 0.0) for mb in mbs]
        total = sum(counts)
        return [c / total for c in counts] if total > 0 else [1.0 / len(mbs)] * len(mbs)

    def adopt_weighting(self, what: str) -> None:
        self.loop_weighting = what
        self.weighting_open = False
        self.notes = {n for n in self.notes if not n.startswith("micro-batches differ in shape")}
        self.notes.add(f"micro-batches differ in shape and the loop weighs them by their {what} "
                       "(as one batch of the whole window would): the loop-as-reference is the "
                       "mean of per-micro-batch gradients weighted so (give the spec a `loss` "
                       "to state the weighting)")


def _own_storage(mb: Any) -> Any:
    if isinstance(mb, dict):
        return {k: v.clone() for k, v in mb.items()}
    return tuple(t.clone() for t in mb)


def _distance(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    total = 0.0
    for name, g in a.items():
        h = b.get(name)
        if g is not None and h is not None:
            total += float(torch.sum((g.double() - h.double()) ** 2))
    return total


def _scale(grads: dict[str, torch.Tensor | None], factor: float) -> dict[str, torch.Tensor | None]:
    return {n: None if g is None else g * factor for n, g in grads.items()}


def _combine(items: list[dict[str, torch.Tensor | None]], weights: list[float]) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for name in items[0]:
        acc = None
        for grads, w in zip(items, weights):
            g = grads.get(name)
            if g is not None:
                acc = g * w if acc is None else acc + g * w
        out[name] = acc
    return out


def flat(session: Session, grads: dict[str, torch.Tensor | None], names: list[str]) -> torch.Tensor:
    return compare.flatten(grads, names, session.param_shapes)
