"""The sentinel's expensive check (`ampdoctor.watch`): the gradient a step consumes against an
fp32 reference of its window, replayed at the same weights under each micro-batch's random
state, compared and named as the ladder compares and names it."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core import thresholds
from ..core.enums import KindId
from ..core.evidence import Evidence
from ..core.findings import location
from ..kinds.matched import ReplayedWeighting, ReplayedWindow, replayed_weighting, replayed_window
from ..maths import compare
from .checks import RUNG, WatchState, Window


@dataclass
class Replayed:
    """The fp32 replay of one window: the reference gradient (the window's mean loss, or
    for a `(loss_sum, n_items)` loss the sum of the loss sums over the sum of the items), and
    for a weighted loss the equal-weight mean of the micro-batches' own means and their counts
    (what a loop that averages per micro-batch consumes instead)."""

    reference: list[torch.Tensor]
    equal: list[torch.Tensor] | None = None
    counts: list[float] | None = None
    own: list[float] | None = None          # the items each micro-batch's own mean divides by

    @property
    def ragged(self) -> bool:
        """Weighted, and the equal-weight mean of the micro-batch means is another gradient:
        the counts differ, or a micro-batch's mean divides by other items than the window's."""
        return self.counts is not None and (len(set(self.counts)) > 1 or self.own != self.counts)


@dataclass(frozen=True)
class ItemLoss:
    """A `loss_fn` result of the framework callbacks: `(loss_sum, n_items)`, and the items the
    model's own per-micro-batch mean divides `loss_sum` by where they are not `n_items` (the
    HF Trainer's `num_items_in_batch` may count a causal LM's tokens unshifted while its loss
    averages over the shifted ones)."""

    loss_sum: torch.Tensor
    n_items: float
    own_items: float


class ReplayCheck(WatchState):
    """The check of a kept window at its optimizer step."""

    #: the framework that drives the run ("HF Trainer", "accelerate"), for the fix's terms
    framework: str | None = None

    def _check_update(self) -> bool:
        """The gradient this step consumes against the fp32 reference of its window; whether
        it could be checked."""
        w = self.window
        assert self.loss_fn is not None
        params = self.params
        replayed = self._reference(w)
        if replayed is None:
            return False
        reference = replayed.reference
        names = [str(i) for i in range(len(params))]
        tol = compare.DEFAULT_TOLERANCES[w.precision]
        plain = compare.metrics_of(dict(zip(names, (p.grad for p in params), strict=True)),
                                   dict(zip(names, reference, strict=True)), names,
                                   {n: p.shape for n, p in zip(names, params, strict=True)},
                                   tol)
        norm_u, norm_r, numel = plain.norm_user, plain.norm_ref, sum(p.numel() for p in params)
        uu, rr, ur = norm_u ** 2, norm_r ** 2, plain.cosine * norm_u * norm_r
        # a clip after unscale_: the consumed gradient is the pre-clip one times its coefficient;
        # its size before the clip is what the clip returned, its direction what is consumed
        pre = norm_u
        clip_max: float | None = None
        if w.clip_max is not None and w.clip_norm is not None and math.isfinite(w.clip_norm):
            clip_max = w.clip_max
            pre = pre if w.clip_scaled else w.clip_norm
        ratio = pre / norm_r if norm_r > 0 else math.inf
        low, high = thresholds.NOISE_RATIO_BAND

        def against(f: float) -> tuple[compare.Metrics, bool]:
            """The metrics against f x the reference as the loop's clip leaves it (c r, from
            the same three sums), and whether the step matches it: a clip that bit on both
            sides hides a factor in the update it consumed now, not in the gradient, so the
            size before the clip must be f x the reference's too (it decides every update the
            clip does not bite)."""
            c = f * (1.0 if clip_max is None
                     else min(1.0, clip_max / (f * norm_r + thresholds.CLIP_EPSILON)))
            diff = math.sqrt(max(uu - 2 * c * ur + c ** 2 * rr, 0.0))
            metrics = compare.metrics_from(norm_u, c * norm_r, diff, lambda: c * ur, numel, tol)
            size_ok = abs(ratio / f - 1) <= tol.rtol or (
                w.precision != "fp32" and low <= ratio / f <= high)
            return metrics, size_ok and (metrics.ok
                                         or compare.is_precision_noise(metrics, w.precision))

        m, ok = against(1.0)
        entry = {"step": self.updates, "precision": w.precision, "ratio": round(ratio, 6),
                 "cosine": round(m.cosine, 6), "relative_error": round(m.rel_err, 6), "ok": ok}
        n = len(w.batches)
        # an epoch's short window divided by K like the full ones (accelerate's backward):
        # n/K of its mean, each micro-batch weighing 1/K -- the convention, not a mistake
        if not ok and 0 < n < self.K and against(n / self.K)[1]:
            entry["ok"] = True
            entry["short_window"] = n
            if not any("short window" in note for note in self.notes):
                self.notes.append(
                    f"optimizer step {self.updates}: a short window of {n} of K={self.K} "
                    f"micro-batches (an epoch's end), divided by K like the full ones: its "
                    f"update is {n}/{self.K} of that window's mean gradient (each "
                    "micro-batch weighs 1/K, the usual convention and accelerate's)")
        explained = self._explained(w)
        if explained:
            entry["explained_by"] = explained
        if replayed.counts is not None:
            entry["counts"] = [_number(c) for c in replayed.counts]
        self.checked.append(entry)
        if not entry["ok"] and not explained:
            self._name_mismatch(w, m, ratio, replayed, pre / norm_u if norm_u > 0 else 1.0)
        return True

    def _explained(self, w: Window) -> str | None:
        """The cheap check that already named what this window's update shows."""
        if w.zero_grad_after is not None:
            return KindId.ZERO_GRAD_INSIDE_ACCUMULATION
        if w.clip_scaled:
            return KindId.CLIP_BEFORE_UNSCALE
        return None

    def _name_mismatch(self, w: Window, m: compare.Metrics, ratio: float, replayed: Replayed,
                       pre_scale: float) -> None:
        tol = compare.hypothesis_tolerance(compare.DEFAULT_TOLERANCES[w.precision].rtol)
        same_way = m.cosine >= thresholds.SAME_DIRECTION_COSINE
        base = m.as_evidence()
        base["ratio"] = round(ratio, 6)
        base["step"] = self.updates
        base["accumulation_steps"] = self.K
        base["precision"] = w.precision
        if self.framework:
            base["framework"] = self.framework
        # against the mean of the window's n micro-batches; a short window (n < K) divided by
        # K is n/K of it (the convention): the factors are said against that
        n = len(w.batches)
        ratios = {ratio, ratio * self.K / n} if 0 < n < self.K else {ratio}
        if same_way and self.K > 1 and any(abs(r / self.K - 1) <= tol for r in ratios):
            factor_kind: KindId | None = KindId.MISSING_ACCUMULATION_AVERAGE
        elif same_way and self.K > 1 and any(abs(r * self.K - 1) <= tol for r in ratios):
            factor_kind = KindId.DOUBLE_AVERAGE
        elif replayed.ragged and self._name_weighting(w, m, ratio, replayed, pre_scale, tol,
                                                       base):
            return
        else:
            factor_kind = None
        self._found(replayed_window(ReplayedWindow(
            RUNG, self.updates, ratio, m.cosine, self.K, w.precision, base, factor_kind,
            m.rel_err, m.allowed / max(m.norm_ref, 1e-30), location=location(w.backward_site))))

    def _name_weighting(self, w: Window, m: compare.Metrics, ratio: float, replayed: Replayed,
                        pre_scale: float, tol: float, base: Evidence) -> bool:
        """A weighted loss on ragged micro-batches: the consumed gradient (before its clip)
        against what a loop that averages each micro-batch alone consumes -- the equal-weight
        mean of the micro-batch means (`weighted-average-mismatch`), K times it (no average
        over the window), 1/K of it (averaged twice). Whether one of them named it."""
        assert replayed.equal is not None and replayed.counts is not None
        params = self.params
        names = [str(i) for i in range(len(params))]
        shapes = {name: p.shape for name, p in zip(names, params, strict=True)}
        consumed = dict(zip(names, (p.grad for p in params), strict=True))
        shapes_of = ((KindId.WEIGHTED_AVERAGE_MISMATCH, 1.0),
                     (KindId.MISSING_ACCUMULATION_AVERAGE, float(self.K)),
                     (KindId.DOUBLE_AVERAGE, 1.0 / self.K))
        best: tuple[float, KindId, float] | None = None
        for kind, factor in shapes_of:
            if kind != KindId.WEIGHTED_AVERAGE_MISMATCH and self.K == 1:
                continue
            # the consumed gradient before the clip is `pre_scale` x the one consumed
            scale = factor / pre_scale
            hyp = dict(zip(names, (e * scale for e in replayed.equal), strict=True))
            err = compare.metrics_of(consumed, hyp, names, shapes,
                                     compare.Tolerance(tol, 0.0)).rel_err
            if err <= tol and (best is None or err < best[0]):
                best = (err, kind, factor)
        if best is None:
            return False
        err, kind, factor = best
        self._found(replayed_weighting(ReplayedWeighting(
            RUNG, self.updates, kind, factor, self.K, ratio, m.cosine, err,
            tuple(replayed.counts),
            tuple(replayed.own) if replayed.own is not None else None, base,
            location=location(w.backward_site))))
        return True

    def _reference(self, w: Window) -> Replayed | None:
        """The fp32 gradient of the window's loss at the weights the step starts from: each
        micro-batch replayed under the random state it was drawn with, autocast off, the
        model's buffers put back; `.grad` is never touched. `loss_fn` returns a micro-batch's
        mean (the window weighs them equally) or `(loss_sum, n_items)` (the window's
        reference is the sum of the sums over the sum of the items)."""
        assert self.loss_fn is not None
        params = self.params
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        if len(w.rng) != len(w.batches):
            self.notes.append(f"optimizer step {self.updates}: {len(w.rng)} forwards for "
                              f"{len(w.batches)} micro-batches; the window is not replayed")
            return None
        cuda = [p.device for p in params[:1] if p.device.type == "cuda"]
        self._replaying = True
        try:
            with torch.random.fork_rng(devices=cuda), torch.enable_grad(), \
                    _autocast_off(params):
                total, equal, counts, own = self._replay_window(w, cuda)
        except Exception as exc:  # noqa: BLE001 - the training goes on; the check says why
            warnings.warn(f"ampdoctor watch: the replay of optimizer step {self.updates} "
                          f"failed ({type(exc).__name__}: {exc}); that window is not checked",
                          stacklevel=3)
            return None
        finally:
            self._replaying = False
            with torch.no_grad():
                for name, b in self.model.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])
        if not w.batches:
            return None
        if equal is None:
            return Replayed([t / len(w.batches) for t in total])
        items = sum(counts)
        if items <= 0:
            self.notes.append(f"optimizer step {self.updates}: no items in the window (every "
                              "n_items was 0); the window is not checked")
            return None
        return Replayed([t / items for t in total], [e / len(counts) for e in equal], counts,
                        own)

    def _replay_window(self, w: Window, cuda: list[torch.device]) -> tuple[
            list[torch.Tensor], list[torch.Tensor] | None, list[float], list[float]]:
        """Each kept micro-batch's fp32 gradient under its random state: their sum, and for
        a weighted loss the sum of each divided by the items of its own mean, with the
        counts and those items."""
        assert self.loss_fn is not None
        params = self.params
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        equal: list[torch.Tensor] | None = None
        counts: list[float] = []
        own: list[float] = []
        weighted: bool | None = None
        for batch, (cpu_rng, cuda_rng) in zip(w.batches, w.rng, strict=True):
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, cuda[0])
            loss, count, own_count = _loss_and_count(self.loss_fn(self.model, batch))
            if weighted is None:
                weighted = count is not None
            if weighted != (count is not None):
                raise TypeError("loss_fn returned a scalar for some micro-batches of the "
                                "window and a (loss_sum, n_items) pair for others")
            if count is not None:
                counts.append(count)
                own.append(own_count if own_count is not None else count)
                if equal is None:
                    equal = [torch.zeros_like(t) for t in total]
                if count <= 0:       # no items: the micro-batch adds nothing
                    continue
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for i, g in enumerate(grads):
                if g is None:
                    continue
                total[i].add_(g.detach().float())
                if equal is not None and count is not None:
                    equal[i].add_(g.detach().float(), alpha=1.0 / (own[-1] or count))
        return total, equal, counts, own

def _loss_and_count(out: Any) -> tuple[torch.Tensor, float | None, float | None]:
    """A `loss_fn` result as (the loss to differentiate in fp32, its item count or None, the
    items its own mean divides by where an `ItemLoss` says)."""
    if isinstance(out, ItemLoss):
        return out.loss_sum.float(), float(out.n_items), float(out.own_items)
    if isinstance(out, (tuple, list)):
        if len(out) != 2:
            raise TypeError(f"loss_fn returned {len(out)} values; a (loss_sum, n_items) pair "
                            "or a scalar loss is expected")
        loss_sum, count = out
        return loss_sum.float(), float(count), None
    return out.float(), None, None


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(float(value), 6)


def precision_now(scaler: Any, params: list[torch.Tensor]) -> str:
    """The precision the forward about to run is in: the autocast around it (fp16 with an
    enabled GradScaler)."""
    if scaler is not None:
        return "fp16"
    for device in {p.device.type for p in params[:1]} | {"cpu"}:
        with contextlib.suppress(Exception):
            if torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
                return "bf16" if dtype == torch.bfloat16 else "fp16"
    return "fp32"


@contextlib.contextmanager
def _autocast_off(params: list[torch.Tensor]) -> Iterator[None]:
    kinds = {p.device.type for p in params} | {"cpu"}
    with contextlib.ExitStack() as stack:
        for kind in kinds:
            with contextlib.suppress(RuntimeError):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def device_of(params: list[torch.Tensor]) -> str:
    return str(params[0].device) if params else "cpu"


