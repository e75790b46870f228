"""The sentinel's expensive check (`ampdoctor.watch`): the gradient a step consumes against an
fp32 reference of its window, replayed at the same weights under each micro-batch's random
state, compared and named as the ladder compares and names it."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .. import compare, deciders, thresholds
from ..deciders import Observed
from ..evidence import Evidence
from ..findings import Severity, location
from .checks import RUNG, WatchState, Window


class ReplayCheck(WatchState):
    """The check of a kept window at its optimizer step."""

    def _check_update(self) -> bool:
        """The gradient this step consumes against the fp32 reference of its window; whether
        it could be checked."""
        w = self.window
        assert self.loss_fn is not None
        params = self.params
        reference = self._reference(w)
        if reference is None:
            return False
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
        coef_r = 1.0
        pre = norm_u
        if w.clip_max is not None and w.clip_norm is not None and math.isfinite(w.clip_norm):
            coef_r = min(1.0, w.clip_max / (norm_r + thresholds.CLIP_EPSILON))
            pre = pre if w.clip_scaled else w.clip_norm
        # against the reference as the loop's clip leaves it (c r): from the same three sums
        diff = math.sqrt(max(uu - 2 * coef_r * ur + coef_r ** 2 * rr, 0.0))
        m = compare.metrics_from(norm_u, coef_r * norm_r, diff, lambda: coef_r * ur, numel, tol)
        ratio = pre / norm_r if norm_r > 0 else math.inf
        # a clip that bit on both sides hides a factor in the update it consumed now, not in
        # the gradient: the size before the clip must match too (it decides every update the
        # clip does not bite)
        low, high = thresholds.NOISE_RATIO_BAND
        size_ok = abs(ratio - 1) <= tol.rtol or (w.precision != "fp32" and low <= ratio <= high)
        entry = {"step": self.updates, "precision": w.precision, "ratio": round(ratio, 6),
                 "cosine": round(m.cosine, 6), "relative_error": round(m.rel_err, 6),
                 "ok": size_ok and (m.ok or compare.is_precision_noise(m, w.precision))}
        explained = self._explained(w)
        if explained:
            entry["explained_by"] = explained
        self.checked.append(entry)
        if not entry["ok"] and not explained:
            self._name_mismatch(w, m, ratio)
        return True

    def _explained(self, w: Window) -> str | None:
        """The cheap check that already named what this window's update shows."""
        if w.zero_grad_after is not None:
            return "zero-grad-inside-accumulation"
        if w.clip_scaled:
            return "clip-before-unscale"
        return None

    def _name_mismatch(self, w: Window, m: compare.Metrics, ratio: float) -> None:
        tol = compare.hypothesis_tolerance(compare.DEFAULT_TOLERANCES[w.precision].rtol)
        same_way = m.cosine >= thresholds.SAME_DIRECTION_COSINE
        base = m.as_evidence()
        base["ratio"] = round(ratio, 6)
        base["step"] = self.updates
        base["accumulation_steps"] = self.K
        base["precision"] = w.precision
        where = location(w.backward_site)
        lead = f"Optimizer step {self.updates}: the optimizer consumed {ratio:.4g}x the fp32 " \
               f"full-window reference gradient (cosine {m.cosine:.5f})"

        def evidence(factor: float | None = None) -> Evidence:
            out = base.copy()
            out["measured"], out["expected"] = round(ratio, 6), 1.0
            if factor is not None:
                out["factor"] = factor
            return out
        if same_way and self.K > 1 and abs(ratio / self.K - 1) <= tol:
            self._found(deciders.missing_accumulation_average(Observed(
                RUNG, Severity.ERROR, f"{lead} = the sum of the K={self.K} micro-batch "
                "gradients: the loss is not divided by accumulation_steps.",
                evidence=evidence(factor=self.K), location=where)))
        elif same_way and self.K > 1 and abs(ratio * self.K - 1) <= tol:
            self._found(deciders.double_average(Observed(
                RUNG, Severity.ERROR, f"{lead} = 1/K of it: the gradient is averaged twice "
                f"(the loss divided by K={self.K} once too often).",
                evidence=evidence(factor=round(1 / self.K, 6)), location=where)))
        else:
            self._found(deciders.gradient_mismatch(Observed(
                RUNG, Severity.ERROR, f"{lead}, beyond the {w.precision} tolerance (relative "
                f"error {m.rel_err:.3g}, allowed {m.allowed / max(m.norm_ref, 1e-30):.3g}).",
                evidence=evidence(), location=where)))

    def _reference(self, w: Window) -> list[torch.Tensor] | None:
        """The fp32 gradient of the window's mean loss at the weights the step starts from:
        each micro-batch replayed under the random state it was drawn with, autocast off,
        the model's buffers put back; `.grad` is never touched."""
        assert self.loss_fn is not None
        params = self.params
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        if len(w.rng) != len(w.batches):
            self.notes.append(f"optimizer step {self.updates}: {len(w.rng)} forwards for "
                              f"{len(w.batches)} micro-batches; the window is not replayed")
            return None
        total: list[torch.Tensor] | None = None
        cuda = [p.device for p in params[:1] if p.device.type == "cuda"]
        self._replaying = True
        try:
            with torch.random.fork_rng(devices=cuda), torch.enable_grad(), \
                    _autocast_off(params):
                for batch, (cpu_rng, cuda_rng) in zip(w.batches, w.rng, strict=True):
                    torch.set_rng_state(cpu_rng)
                    if cuda_rng is not None:
                        torch.cuda.set_rng_state(cuda_rng, cuda[0])
                    loss = self.loss_fn(self.model, batch).float()
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                    if total is None:
                        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
                    for t, g in zip(total, grads, strict=True):
                        if g is not None:
                            t.add_(g.detach().float())
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
        if total is None:
            return None
        return [t / len(w.batches) for t in total]


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


