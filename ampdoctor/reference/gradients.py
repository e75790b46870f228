"""The teacher-forced fp32 reference gradients (DESIGN §1), as the loop meant them.

For one optimizer step: the micro-batches the step consumed, at the parameters the step saw,
from the spec's `loss` (the equal-weight mean of micro-batch means, or the global weighted mean
of `(loss_sum, weight_sum)` pairs) or, without one, from the user's own loop run in fp32 at
K = 1 on one micro-batch holding the step's data. Every forward of micro-batch i runs under the
same RNG state as in the loop's runs (`dropout: align`). Models that normalise over the batch
(BatchNorm) or draw aligned dropout masks per micro-batch combine per-micro-batch runs instead;
micro-batches that cannot be concatenated are weighted as the loop weighs them.

`ReferenceBuilder` is a mixin of `Session`, which owns the user's code, the device and the
micro-batches; the reference is cached per window and parameter state by the callers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ..core.errors import UserCodeError, exc_text
from ..loading import build_model, merge_micro_batches, micro_batch_counts, micro_batch_size_of
from ..maths import compare, rng
from ..probe import recorder, spill
from ..probe.trace import Trace, WeightsCast

if TYPE_CHECKING:
    from ..loading import UserCode
    from ..probe.feed import MicroBatchIndex
    from ..probe.observer import ProbeSettings
    from ..spec import Spec

RANDOM_MODULE_TYPES = (
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout",
    "RReLU",
)


@dataclass
class WindowReference:
    """The fp32 reference of one window at one parameter state."""

    full: dict[str, torch.Tensor | None]        # unclipped step gradient
    per_mb: list[dict[str, torch.Tensor | None]] | None
    counts: list[float] | None
    weighted: bool
    mode: str                                   # "loss" or "loop"
    #: the loop-as-reference of micro-batches that cannot form one batch, weighted equally for
    #: want of a known weighting: a guess the judge may correct (`judge.weighting_of`)
    guessed_weighting: bool = False


@dataclass
class CachedReference:
    """The reference kept for reuse at the initial weights (`ReferenceBuilder._ref_cache`): a
    large one's gradient on disk, read back for each use, so it is not in memory through the
    runs' later steps (when their optimizer state is); a small one in memory."""

    ref: WindowReference
    stored: spill.Spilled | None = None

    @classmethod
    def of(cls, ref: WindowReference) -> CachedReference:
        if spill.size_of(ref.full) < spill.SPILL_BYTES:
            return cls(ref)
        return cls(dataclasses.replace(ref, full={}), spill.Spilled(dict(ref.full)))

    def get(self) -> WindowReference:
        if self.stored is None:
            return self.ref
        return dataclasses.replace(self.ref, full=self.stored.read_fresh())


#: `weighting` of a reference: as the session knows it (`loop_weighting`).
SESSION_WEIGHTING = "loop"


class ReferenceBuilder:
    """The reference computations of a `Session` (see the module docstring)."""

    # What the session holds (`Session.__init__`) and does, used here.
    spec: Spec
    code: UserCode
    device: torch.device
    micro_batches: list[Any]
    batch_index: MicroBatchIndex
    align_seed: int | None
    initial_state: Mapping[str, torch.Tensor]
    param_order: list[str]
    notes: set[str]
    loop_weighting: str | None
    _template: torch.nn.Module
    _ref_model: torch.nn.Module | None
    #: the parameters the loop's model did not train at its last step group (frozen by the
    #: loop itself: `requires_grad_(False)` on the model it was handed), None before any
    #: run reached a step; the reference model trains what the loop trains
    loop_frozen: frozenset[str] | None = None
    window: Callable[[int], list[Any]]
    probe_settings: Callable[..., ProbeSettings]
    run_loop: Callable[..., Trace]
    _refuse_data_dtype: Callable[[BaseException, tuple[str, int] | None, str], None]

    #: The last reference computed at the initial weights, with its key (`_cache_key`).
    _ref_cache: tuple[tuple[Any, ...], CachedReference] | None = None

    def random_modules(self) -> list[str]:
        found = []
        for name, module in self._template.named_modules():
            cls = type(module).__name__
            if cls in RANDOM_MODULE_TYPES and module.training:
                p = getattr(module, "p", getattr(module, "lower", None))
                if "Dropout" in cls and not p:
                    continue
                found.append(f"{name or '(model)'} ({cls}{f', p={p}' if p is not None else ''})")
        return found

    def has_batch_statistics(self) -> bool:
        return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
                   for m in self._template.modules())

    def _model_at(self, state: Mapping[str, torch.Tensor], training: bool) -> torch.nn.Module:
        model = self._ref_model
        if model is None:
            model = self._ref_model = build_model(self.code, self.device, self.spec.seed)
            recorder.ForwardAligner(self.batch_index, self.align_seed).attach(model)
        model.load_state_dict({k: v.to(self.device) for k, v in state.items()})
        model.train(training)
        # the factory's flags (the template's), less what the loop froze
        frozen = self._frozen_by_loop()
        for (n, p), built in zip(model.named_parameters(), self._template.parameters(),
                                 strict=True):
            p.requires_grad_(built.requires_grad and n not in frozen)
        return model

    def loop_froze(self, frozen: frozenset[str]) -> None:
        """The loop's model does not train `frozen` (`Probe.on_frozen`): the references from
        now on leave them out, as the loop's optimizer steps do."""
        before = self._frozen_by_loop()
        self.loop_frozen = frozen
        if self._frozen_by_loop() != before:
            self._ref_cache = None

    def _frozen_by_loop(self) -> frozenset[str]:
        """What the loop froze that the model's factory did not (a reference cached before
        any run, and one after a run that froze nothing, are the same reference)."""
        frozen = self.loop_frozen or frozenset()
        return frozenset(n for n, p in self._template.named_parameters()
                         if n in frozen and p.requires_grad)

    def _grads_of(self, model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
        """The model's gradients as fp32 host tensors; the model's .grad are left None. A grad
        already on the host in fp32 is taken as it is (no second copy of the model's gradient)."""
        out: dict[str, torch.Tensor | None] = {}
        for n, p in model.named_parameters():
            g = p.grad
            if g is None:
                out[n] = None
                continue
            p.grad = None
            g = compare.dense(g.detach())
            out[n] = g if g.device.type == "cpu" and g.dtype == torch.float32 \
                and type(g) is torch.Tensor else g.to("cpu", torch.float32, copy=True)
        return out

    def reference(self, window: int, state: Mapping[str, torch.Tensor] | None = None,
                  training: bool = True, rng_seed: int | None = None,
                  per_mb: bool = True, weighting: str | None = SESSION_WEIGHTING
                  ) -> WindowReference:
        return self.reference_for(self.window(window), state, training, rng_seed, per_mb,
                                  label=f"window {window}", weighting=weighting)

    def reference_for(self, mbs: list[Any], state: Mapping[str, torch.Tensor] | None = None,
                      training: bool = True, rng_seed: int | None = None, per_mb: bool = True,
                      label: str = "window", weighting: str | None = SESSION_WEIGHTING
                      ) -> WindowReference:
        """The fp32 reference gradient of one optimizer step over `mbs` at `state`.

        `weighting`: how the loop weighs micro-batches that cannot form one batch (a key of
        `micro_batch_counts`, None: equally), SESSION_WEIGHTING: as the session knows it."""
        state = self.initial_state if state is None else state
        if weighting == SESSION_WEIGHTING:
            weighting = self.loop_weighting
        key = self._cache_key(mbs, state, training, rng_seed, per_mb, weighting)
        cached = self._ref_cache
        if key is not None and cached is not None and cached[0] == key:
            return cached[1].get()
        previous = recorder.activate(None)
        try:
            with recorder.observing(self.probe_settings()):
                if rng_seed is not None:
                    rng.manual_seed(rng_seed)
                if self.code.loss is not None:
                    ref = self._reference_from_loss(mbs, state, training, per_mb)
                else:
                    ref = self._reference_from_loop(mbs, state, training, per_mb, weighting)
        except Exception:
            self._drop_reference_gradients()
            raise
        finally:
            recorder.activate(previous)
        ref = self._check_finite(ref, label)
        if key is not None:
            self._ref_cache = (key, CachedReference.of(ref))
        return ref

    def _drop_reference_gradients(self) -> None:
        """A reference that failed half-way (out of memory) keeps no gradients on the reference
        model (set directly: a zero_grad() inside the loop's step would be recorded as the
        loop's)."""
        if self._ref_model is not None:
            for param in self._ref_model.parameters():
                param.grad = None

    #: Set once the reproducibility rung found two fp32 references at the same weights equal:
    #: from then on a reference at weights already seen is reused instead of recomputed.
    reference_repeatable = False

    def remember_reference(self, window: int, ref: WindowReference, training: bool = True) -> None:
        """Keep `ref`, computed at the initial weights on `window`, as the cached reference
        (the reproducibility rung's, once it proved the reference repeatable to the bit)."""
        key = self._cache_key(self.window(window), self.initial_state, training, None, False,
                              self.loop_weighting)
        if key is not None and ref.per_mb is None:
            self._ref_cache = (key, CachedReference.of(ref))

    def _cache_key(self, mbs: list[Any], state: Mapping[str, torch.Tensor], training: bool,
                   rng_seed: int | None, per_mb: bool, weighting: str | None
                   ) -> tuple[Any, ...] | None:
        """A key for the reference of a window at the initial weights (the first step of every
        run sees them), or None when this reference is not to be cached. Only one is kept."""
        if not self.reference_repeatable or rng_seed is not None or per_mb:
            return None
        position = {id(mb): i for i, mb in enumerate(self.micro_batches)}
        ids = tuple(position.get(id(mb)) for mb in mbs)
        if not ids or None in ids:
            return None
        if state is not self.initial_state and not compare.same_tensors(state, self.initial_state):
            return None
        return (ids, training, weighting, self._frozen_by_loop())

    def _check_finite(self, ref: WindowReference, window: str) -> WindowReference:
        bad = [n for n, g in ref.full.items() if g is not None and not compare.all_finite(g)]
        if bad:
            raise UserCodeError(
                f"the fp32 reference gradient of {window} is not finite (parameter "
                f"{bad[0]}): the baseline itself diverges, so no comparison means anything. Check "
                "the data slice and the loss.")
        return ref

    def _reference_from_loss(self, mbs: list[Any], state: Mapping[str, torch.Tensor],
                             training: bool, per_mb: bool = True) -> WindowReference:
        """The reference from the spec's `loss`: the mean of the micro-batch losses' gradients,
        or, for `(loss_sum, weight_sum)`, the sum of the loss sums' gradients over the sum of
        the weights. Without `per_mb`, autograd accumulates the window in .grad (one copy of
        the gradients instead of K)."""
        model = self._model_at(state, training)
        loss_fn = cast(Callable[..., Any], self.code.loss)   # called only when the spec has one
        per: list[dict[str, torch.Tensor | None]] = []
        counts: list[float] = []
        weighted = False
        model.zero_grad(set_to_none=True)
        for index, mb in enumerate(mbs):
            if per_mb:
                model.zero_grad(set_to_none=True)
            out = self._user_loss("the loss function", loss_fn, model, mb)
            if isinstance(out, (tuple, list)) and len(out) == 2:
                weighted = True
                loss_sum, weight = out
                weight = (float(weight.detach()) if isinstance(weight, torch.Tensor)
                          else float(weight))
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
            self._user_loss("backward through the loss function", loss.backward)
            if per_mb:
                per.append(self._grads_of(model))
            counts.append(weight)
        if per_mb:
            # per micro-batch: the mean (weighted: loss_sum / weight) of each one
            sums = per
            if weighted:
                per = [_scale(g, 1.0 / w) for g, w in zip(sums, counts, strict=True)]
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

    def _user_loss(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call the spec's loss (or backward through it): a dtype error that names a field of
        the data is the data factory's (exit 2, `Session._refuse_data_dtype`), any other error
        the user's code's (exit 3)."""
        try:
            return self.code.call(what, fn, *args)
        except UserCodeError as err:
            if err.cause is not None:
                self._refuse_data_dtype(err.cause, err.location, what)
            raise

    def loop_gradient(self, mbs: list[Any], state: Mapping[str, torch.Tensor], training: bool,
                      K: int = 1) -> dict[str, torch.Tensor | None]:
        """Run the user's loop in fp32 from `state` on `mbs` and return the first step's
        gradients (all optimizers), before clipping."""
        no_clip = math.inf if self.spec.max_grad_norm is not None else None
        trace = self.run_loop("fp32", micro_batches=mbs, K=K, state=state, training=training,
                              max_grad_norm=no_clip)
        if trace.cast is not None:   # not an fp32 reference (`ladder.casts`)
            raise WeightsCast(trace)
        if trace.error is not None:
            site = trace.error_site
            where = f" at {site.file}:{site.line}" if site else ""
            raise UserCodeError(
                "the reference run (your train_loop in fp32 with K = 1 on one micro-batch holding "
                f"the whole step's data) raised{where}: {exc_text(trace.error)}. Give the spec "
                "a `loss` callable to use ampdoctor's own reference.",
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

    def _reference_from_loop(self, mbs: list[Any], state: Mapping[str, torch.Tensor],
                             training: bool, per_mb: bool, weighting: str | None
                             ) -> WindowReference:
        batch_stats = self.has_batch_statistics()
        # Aligned dropout draws its masks per micro-batch: one batch of the whole window would
        # draw others, so the reference combines per-micro-batch runs, as for BatchNorm.
        aligned = self.align_seed is not None and bool(self.random_modules())
        per: list[dict[str, torch.Tensor | None]] | None = None
        guessed = False
        if per_mb or batch_stats or aligned:
            per = [self.loop_gradient([mb], state, training) for mb in mbs]
        if per is not None and (batch_stats or aligned):
            merged = merge_micro_batches(mbs)
            whole = (self.loop_gradient([merged], state, training) if merged is not None
                     else None)
            full = per_microbatch_full(per, whole)
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
                full = _combine(per, self.fallback_weights(mbs, weighting))
                guessed = weighting is None
                if guessed:
                    self.notes.add("micro-batches differ in shape: the loop-as-reference is the "
                                   "equal-weight mean of per-micro-batch gradients (give the "
                                   "spec a `loss` to state the weighting)")
            else:
                full = self.loop_gradient([merged], state, training)
        counts = [float(micro_batch_size_of(mb)) for mb in mbs]
        return WindowReference(full, per, counts, False, "loop", guessed)

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
        """The loop weighs micro-batches by their count of `what` (the judge found it): every
        reference from now on is weighted so."""
        self.loop_weighting = what
        self.notes = {n for n in self.notes if not n.startswith("micro-batches differ in shape")}
        self.notes.add("micro-batches differ in shape and the loop weighs each by its count of "
                       f"{what} "
                       "(as one batch of the whole window would): the loop-as-reference is the "
                       "mean of per-micro-batch gradients weighted so (give the spec a `loss` "
                       "to state the weighting)")


def per_microbatch_full(per: list[dict[str, torch.Tensor | None]],
                        whole: dict[str, torch.Tensor | None] | None
                        ) -> dict[str, torch.Tensor | None]:
    """The window's reference of a model that normalises over the batch (BatchNorm), from its
    micro-batches' own gradients `per`. Its statistics are per micro-batch: the full-batch
    gradient `whole` is not what a correct accumulation computes, the mean (or, for a loss that
    sums over samples, the sum) of the micro-batch gradients is. Which of the two the loss does,
    `whole` still tells: it is far closer to one than to the other (a factor K apart)."""
    mean = _combine(per, [1.0 / len(per)] * len(per))
    if whole is None:
        return mean
    total = _combine(per, [1.0] * len(per))
    return total if _distance(whole, total) < _distance(whole, mean) else mean


def _distance(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    total = 0.0
    for name, g in a.items():
        h = b.get(name)
        if g is not None and h is not None:
            total += float(torch.sum((g.double() - h.double()) ** 2))
    return total


def _scale(grads: dict[str, torch.Tensor | None], factor: float) -> dict[str, torch.Tensor | None]:
    return {n: None if g is None else g * factor for n, g in grads.items()}


def _combine(items: list[dict[str, torch.Tensor | None]],
             weights: list[float]) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for name in items[0]:
        acc = None
        for grads, w in zip(items, weights, strict=False):
            g = grads.get(name)
            if g is not None:
                acc = g * w if acc is None else acc + g * w
        out[name] = acc
    return out
