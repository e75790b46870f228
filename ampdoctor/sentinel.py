"""`ampdoctor.watch`: a sentinel inside real training that checks, without changing it, that
each update is the one an fp32 full batch would give.

Every optimizer step it checks what is cheap and exact (counts of calls, the scaler's state):
backwards per step against K, `zero_grad` inside a window, a clip on still-scaled gradients,
a scheduler stepped per micro-batch or on skipped steps, a scaler that keeps skipping. Every
`every` optimizer steps (and on the second window, so a bug shows at once) it checks the
expensive thing: the gradient the optimizer is about to consume against an fp32 full-window
reference at the same weights on the same micro-batches (kept for that window only, replayed
with their random state), in the same kinds, numbers and user line as the ladder.

Nothing of the training changes: the counts come from hooks and from wrappers that call the
originals; the replay computes its gradients with `torch.autograd.grad` (no `.grad` touched),
under the random state each micro-batch had, with the model's buffers put back and the random
state restored after. Memory: the reference's gradient (one fp32 copy of the gradients) during
a checked window, nothing between.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import compare, deciders, thresholds
from .deciders import Observed
from .evidence import Evidence
from .findings import Finding, Location, Severity, location
from .probe.callsite import CallSiteFinder, Site

#: the rung id of what the sentinel finds (a watched run has no ladder)
RUNG = "watch"
#: optimizer steps between two expensive checks, by default
DEFAULT_EVERY = 500
#: the first window checked the expensive way (0-based): the second, so that a bug shows at
#: once while the first window's one-off effects (a scaler's first calibration) are past
FIRST_CHECKED_WINDOW = 1
#: steps whose backward counts decide `step-per-microbatch` (a ragged last window of an
#: epoch is normal; a count of one on every one of these is not)
COUNT_WINDOWS = 3


class WatchError(AssertionError):
    """Raised from the training step with `on_error="raise"`: the finding is its message."""

    def __init__(self, finding: Finding):
        self.finding = finding
        loc = f" at {finding.location.file}:{finding.location.line}" if finding.location else ""
        super().__init__(f"ampdoctor watch: {finding.kind}{loc}: {finding.message}")


@dataclass
class _Window:
    """What happened since the last optimizer step (or skipped scaler step)."""

    backwards: int = 0
    backward_site: Site | None = None
    zero_grad_after: int | None = None        # backwards before a zero_grad inside the window
    zero_grad_site: Site | None = None
    unscaled: bool = False
    clip_norm: float | None = None            # what the clip returned (the pre-clip norm)
    clip_max: float | None = None
    clip_scaled: bool = False                 # the clip saw still-scaled gradients
    scheduler_steps: int = 0
    scheduler_site: Site | None = None
    batches: list[Any] = field(default_factory=list)
    rng: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    precision: str = "fp32"


class Watch:
    """The sentinel of one training run (see the module docstring). Use it as a context
    manager around the loop; `batches(iterable)` hands the loop its micro-batches and keeps
    those of a checked window."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 accumulation_steps: int, scaler: Any = None, scheduler: Any = None,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
                 every: int = DEFAULT_EVERY, on_error: str = "warn",
                 out: str | Path | None = None, name: str = "watched run"):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, not {accumulation_steps}")
        if every < 1:
            raise ValueError(f"every must be >= 1, not {every}")
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', not {on_error!r}")
        self.model, self.optimizer = model, optimizer
        self.K = int(accumulation_steps)
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.every, self.on_error, self.out, self.name = every, on_error, out, name
        self.finder = CallSiteFinder()
        self.params = [p for g in optimizer.param_groups for p in g["params"]
                       if p.requires_grad]
        self.findings: list[Finding] = []
        self.window = _Window()
        self.windows = 0                 # windows closed (optimizer steps and skips)
        self.updates = 0                 # real optimizer steps
        self.skips: list[int] = []       # the windows whose scaler step skipped
        self.scheduler_on_skip: list[int] = []
        self.counts: list[int] = []      # backwards of the first windows
        self.scheduler_counts: list[int] = []
        self.checked: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.scheduler_site: Site | None = None
        self._fires: dict[int, int] = {}
        self._replaying = False
        self._pending = False            # a checked window that could not be checked
        self._in_scaler_step = False
        self._stepped_in_scaler = False
        self._undo: list[Callable[[], None]] = []
        self.started = time.perf_counter()
        self.record: dict[str, Any] | None = None
        #: where the loop built its GradScaler (the line a frequent-skips finding names)
        self.scaler_site = _built_at(self.scaler, sys._getframe(1), self.finder) \
            if self.scaler is not None else None

    # ------------------------------------------------------------------ set up and take down
    def __enter__(self) -> Watch:
        for p in self.params:
            handle = p.register_post_accumulate_grad_hook(self._on_grad)
            self._undo.append(handle.remove)
        handle = self.optimizer.register_step_pre_hook(self._on_step)
        self._undo.append(handle.remove)
        handle = self.model.register_forward_pre_hook(self._on_forward)
        self._undo.append(handle.remove)
        self._patch_attr(torch.Tensor, "backward", self._wrap_backward(torch.Tensor.backward))
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            self._patch_attr(owner, "clip_grad_norm_", self._wrap_clip(owner.clip_grad_norm_))
        for obj in (self.optimizer, self.model):
            self._patch_instance(obj, "zero_grad", self._wrap_zero_grad(obj.zero_grad))
        if self.scaler is not None:
            self._patch_instance(self.scaler, "step", self._wrap_scaler_step(self.scaler.step))
            self._patch_instance(self.scaler, "unscale_",
                                 self._wrap_unscale(self.scaler.unscale_))
        if self.scheduler is not None:
            self._patch_instance(self.scheduler, "step",
                                 self._wrap_scheduler_step(self.scheduler.step))
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if self.skips and exc[0] is None:
            with contextlib.suppress(WatchError):
                self._judge_skips()
        self.record = self._make_record()
        if self.out is not None:
            from .record import save
            self.record["path"] = str(save(self.record, Path(self.out)))

    def _patch_attr(self, owner: Any, name: str, value: Any) -> None:
        original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def _patch_instance(self, obj: Any, name: str, value: Any) -> None:
        had = name in obj.__dict__
        original = obj.__dict__.get(name)
        obj.__dict__[name] = value

        def undo() -> None:
            if had:
                obj.__dict__[name] = original
            else:
                obj.__dict__.pop(name, None)
        self._undo.append(undo)

    # ------------------------------------------------------------------ the micro-batches
    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """The loop's micro-batches, as they are; those of a window the sentinel checks the
        expensive way are kept (with the random state each was drawn under) until its step."""
        for batch in iterable:
            if self._checking():
                self.window.batches.append(batch)
            yield batch

    def _checking(self) -> bool:
        """Whether the micro-batches of the window now running are kept: the first checked
        one, every `every`-th, and the one after a checked window that could not be checked
        (its step skipped, its forwards not one per micro-batch)."""
        w = self.windows
        return self.loss_fn is not None and (
            self._pending or w == FIRST_CHECKED_WINDOW
            or (w > FIRST_CHECKED_WINDOW and w % self.every == 0))

    # ------------------------------------------------------------------ what the loop calls
    def _on_forward(self, module: Any, args: Any) -> None:
        """Right before each forward of a checked window: the random state its dropout draws
        from, and the precision it runs in (the autocast around it)."""
        w = self.window
        if self._replaying or not w.batches:
            return
        cuda = [p.device for p in self.params[:1] if p.device.type == "cuda"]
        w.rng.append((torch.get_rng_state(),
                      torch.cuda.get_rng_state(cuda[0]) if cuda else None))
        w.precision = _precision_now(self.scaler, self.params)

    def _site(self) -> Site | None:
        return self.finder.from_frame(sys._getframe(2))

    def _on_grad(self, param: torch.Tensor) -> None:
        key = id(param)
        self._fires[key] = self._fires.get(key, 0) + 1
        self.window.backwards = max(self.window.backwards, self._fires[key])

    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            site = watch._site()
            if site is not None:
                watch.window.backward_site = site
            return original(tensor, *args, **kwargs)
        return backward

    def _wrap_zero_grad(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            w = watch.window
            if w.backwards and w.zero_grad_after is None:
                w.zero_grad_after, w.zero_grad_site = w.backwards, watch._site()
            return original(*args, **kwargs)
        return zero_grad

    def _wrap_unscale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def unscale_(optimizer: Any) -> Any:
            if optimizer is watch.optimizer:
                watch.window.unscaled = True
            return original(optimizer)
        return unscale_

    def _wrap_clip(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            parameters = list(parameters)
            norm = original(parameters, max_norm, *args, **kwargs)
            ours = {id(p) for p in watch.params}
            if any(id(p) in ours for p in parameters):
                watch._on_clip(norm, float(max_norm), watch._site())
            return norm
        return clip_grad_norm_

    def _on_clip(self, norm: Any, max_norm: float, site: Site | None) -> None:
        w = self.window
        w.clip_norm, w.clip_max = float(norm), max_norm
        if self.scaler is None or w.unscaled:
            return
        w.clip_scaled = True
        scale = float(self.scaler.get_scale())
        if scale == 1.0 or not math.isfinite(w.clip_norm):
            return
        true = w.clip_norm / scale
        message = (f"Optimizer step {self.updates}: clip_grad_norm_ ran before "
                   f"scaler.unscale_: it saw a gradient norm of {w.clip_norm:.6g} where the true "
                   f"norm is {true:.6g} (the loss scale {scale:g}), so the threshold "
                   f"{max_norm:g} was applied in scaled space"
                   + (" and the update shrank to "
                      f"{min(1.0, max_norm / w.clip_norm) / min(1.0, max_norm / true):.3g}x "
                      "the one clipped in true space." if w.clip_norm > max_norm else "."))
        bites = w.clip_norm > max_norm
        self._found(deciders.clip_before_unscale(Observed(
            RUNG, Severity.ERROR if bites else Severity.WARNING, message,
            evidence={"measured": round(w.clip_norm / max(true, 1e-30), 6), "expected": 1.0,
                      "scale": scale, "norm_seen_by_clip": round(w.clip_norm, 6),
                      "true_norm": round(true, 6), "max_grad_norm": max_norm,
                      "step": self.updates},
            location=location(site))))

    def _wrap_scheduler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def step(*args: Any, **kwargs: Any) -> Any:
            w = watch.window
            w.scheduler_steps += 1
            if w.scheduler_site is None:
                w.scheduler_site = watch._site()
                watch.scheduler_site = watch.scheduler_site or w.scheduler_site
            if watch.skips and watch.skips[-1] == watch.windows - 1 and w.backwards == 0:
                watch.scheduler_on_skip.append(watch.windows - 1)
            return original(*args, **kwargs)
        return step

    def _wrap_scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if optimizer is not watch.optimizer:
                return original(optimizer, *args, **kwargs)
            watch._in_scaler_step, watch._stepped_in_scaler = True, False
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                watch._in_scaler_step = False
                if not watch._stepped_in_scaler:       # inf/nan found: the step was skipped
                    watch.skips.append(watch.windows)
                    watch._pending = watch._pending or bool(watch.window.batches)
                    watch._close_window(stepped=False)
        return step

    # ------------------------------------------------------------------ the optimizer step
    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._in_scaler_step:
            self._stepped_in_scaler = True
        if self.window.batches and self.window.backwards:
            self._pending = not self._check_update()
        self.updates += 1
        self._close_window(stepped=True)

    def _close_window(self, stepped: bool) -> None:
        w = self.window
        if len(self.counts) < COUNT_WINDOWS and w.backwards:
            self.counts.append(w.backwards)
            if len(self.counts) == COUNT_WINDOWS:
                self._judge_counts(w)
        if w.zero_grad_after is not None and w.backwards > w.zero_grad_after:
            self._zero_grad_inside(w)
        if len(self.scheduler_counts) < COUNT_WINDOWS and w.backwards:
            self.scheduler_counts.append(w.scheduler_steps)
            if len(self.scheduler_counts) == COUNT_WINDOWS:
                self._judge_scheduler(w)
        self.window = _Window()
        self._fires.clear()
        self.windows += 1
        if stepped and self.skips and self.windows % 50 == 0:
            self._judge_skips()

    # ------------------------------------------------------------------ the cheap checks
    def _judge_counts(self, w: _Window) -> None:
        if self.K > 1 and all(c == 1 for c in self.counts):
            self._found(deciders.step_per_microbatch(Observed(
                RUNG, Severity.ERROR,
                f"Each of the first {COUNT_WINDOWS} optimizer steps consumed the gradient of one "
                f"backward where K={self.K} were meant: the optimizer steps every micro-batch, "
                f"{self.K}x as many updates each on 1/{self.K} of the data.",
                evidence={"measured": 1, "expected": self.K, "accumulation_steps": self.K,
                          "backwards_per_step": list(self.counts)},
                location=location(w.backward_site))))

    def _zero_grad_inside(self, w: _Window) -> None:
        kept = w.backwards - (w.zero_grad_after or 0)
        self._found(deciders.zero_grad_inside_accumulation(Observed(
            RUNG, Severity.ERROR,
            f"Optimizer step {self.updates}: zero_grad ran after {w.zero_grad_after} of the "
            f"window's {w.backwards} backwards, so the step consumed the gradient of only the "
            f"last {kept} micro-batch(es): the earlier ones were thrown away.",
            evidence={"measured": kept, "expected": w.backwards,
                      "accumulation_steps": self.K, "step": self.updates},
            location=location(w.zero_grad_site))))

    def _judge_scheduler(self, w: _Window) -> None:
        counts = self.scheduler_counts
        # once per micro-batch: K per window (K - 1 in the first, whose step ends it before
        # the last micro-batch's scheduler step)
        if self.K > 1 and all(c >= max(2, self.K - 1) for c in counts):
            self._found(deciders.scheduler_per_microbatch(Observed(
                RUNG, Severity.ERROR,
                f"The scheduler ({type(self.scheduler).__name__}) stepped {max(counts)} times per "
                f"optimizer step, once per micro-batch: the schedule runs {self.K}x too fast "
                "(a 10,000-step schedule is over after "
                f"{10_000 // self.K:,} real updates).",
                evidence={"measured": max(counts), "expected": 1, "accumulation_steps": self.K,
                          "scheduler_steps_per_update": list(counts)},
                location=location(w.scheduler_site))))

    def _judge_skips(self) -> None:
        """A scaler that keeps skipping after it settled, and a scheduler that advanced on
        the skips (by consequence: `deciders.schedule_on_skips`)."""
        skipped = set(self.skips)
        first_real = next((i for i in range(self.windows) if i not in skipped), 0)
        steady = [s for s in self.skips if s > first_real]
        after = self.windows - first_real - 1
        rate = len(steady) / after if after > 0 else 0.0
        if len(steady) >= thresholds.MIN_COUNTED_SKIPS and rate > thresholds.SKIP_RATE_THRESHOLD \
                and self.scaler is not None:
            sc = self.scaler
            settings = (f"growth_factor={sc.get_growth_factor():g}, growth_interval="
                        f"{sc.get_growth_interval()}, backoff_factor={sc.get_backoff_factor():g}")
            self._found(deciders.frequent_skips(Observed(
                RUNG, Severity.ERROR,
                f"After the loss scale settled, {len(steady)} of the {after} optimizer steps that "
                f"followed were skipped (inf/nan gradients; a rate of {rate:.0%}): those "
                f"windows' data never reaches the weights. The GradScaler runs with {settings}; "
                "the defaults (2.0, 2000, 0.5) settle to a skip every few thousand steps.",
                evidence={"measured": round(rate, 6), "expected": 0.0,
                          "threshold": thresholds.SKIP_RATE_THRESHOLD,
                          "skipped": len(steady), "steps": after,
                          "scale": float(sc.get_scale()),
                          "growth_factor": sc.get_growth_factor(),
                          "growth_interval": sc.get_growth_interval()},
                location=location(self.scaler_site))))
        if self.scheduler is None or not self.scheduler_on_skip:
            return
        on_calibration = sum(1 for s in self.scheduler_on_skip if s < first_real)
        on_steady = sum(1 for s in self.scheduler_on_skip if s > first_real)
        finding = deciders.schedule_on_skips(deciders.ScheduleOnSkips(
            rung=RUNG, scheduler_type=type(self.scheduler).__name__,
            location=location(self.scheduler_site),
            calibration_skips=on_calibration, steady_skips=on_steady,
            steps_after_settling=after, scheduler_steps=self.updates + len(self.skips),
            real_updates=self.updates, lr_shift=0.0, lr_step=None, lr_used=None,
            lr_meant=None, tolerance=thresholds.FP16_RTOL, own_scaler=True))
        if finding is not None:
            self._found(finding)

    # ------------------------------------------------------------------ the expensive check
    def _check_update(self) -> bool:
        """The gradient this step consumes against the fp32 reference of its window; whether
        it could be checked."""
        w = self.window
        assert self.loss_fn is not None
        params = self.params
        reference = self._reference(w)
        if reference is None:
            return False
        uu = rr = ur = 0.0
        for p, r in zip(params, reference, strict=True):
            g = p.grad
            rr += float(r.double().pow(2).sum())
            if g is not None:
                gd = g.detach().double()
                uu += float(gd.pow(2).sum())
                ur += float((gd * r.double()).sum())
        numel = sum(p.numel() for p in params)
        norm_u, norm_r = math.sqrt(uu), math.sqrt(rr)
        # a clip after unscale_: the consumed gradient is the pre-clip one times its coefficient;
        # its size before the clip is what the clip returned, its direction what is consumed
        coef_r = 1.0
        pre = norm_u
        if w.clip_max is not None and w.clip_norm is not None and math.isfinite(w.clip_norm):
            coef_r = min(1.0, w.clip_max / (norm_r + thresholds.CLIP_EPSILON))
            pre = pre if w.clip_scaled else w.clip_norm
        diff = math.sqrt(max(uu - 2 * coef_r * ur + coef_r ** 2 * rr, 0.0))
        tol = compare.DEFAULT_TOLERANCES[w.precision]
        m = compare._metrics(norm_u, coef_r * norm_r, diff, lambda: coef_r * ur, numel, tol)
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

    def _explained(self, w: _Window) -> str | None:
        """The cheap check that already named what this window's update shows."""
        if w.zero_grad_after is not None:
            return "zero-grad-inside-accumulation"
        if w.clip_scaled:
            return "clip-before-unscale"
        return None

    def _name_mismatch(self, w: _Window, m: compare.Metrics, ratio: float) -> None:
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

    def _reference(self, w: _Window) -> list[torch.Tensor] | None:
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

    # ------------------------------------------------------------------ findings and record
    def _found(self, finding: Finding) -> None:
        """Each kind once, at its most severe (a warning an error of the same kind replaces);
        said as a warning, or raised (`on_error="raise"`) when it is an error."""
        same = [f for f in self.findings if f.kind == finding.kind]
        if same and (same[0].severity == Severity.ERROR or finding.severity != Severity.ERROR):
            return
        if same:
            self.findings.remove(same[0])
        self.findings.append(finding)
        if self.on_error == "raise" and finding.severity == Severity.ERROR:
            raise WatchError(finding)
        text = f"ampdoctor watch: {finding.severity} {finding.kind}"
        if finding.location is not None:
            text += f" at {finding.location.file}:{finding.location.line}"
        warnings.warn(f"{text}: {finding.message}", stacklevel=4)

    def _make_record(self) -> dict[str, Any]:
        from .runner import blank_record, environment
        errors = [f for f in self.findings if f.severity == Severity.ERROR]
        record = blank_record(spec=None, source={}, name=self.name, device=_device(self.params),
                              accumulation_steps=self.K, optimizer_steps=self.updates,
                              micro_batch_size=None, environment=environment(None))
        record["verdict"] = "failed" if errors else "healthy"
        record["failed_rung"] = RUNG if errors else None
        status = "fail" if errors else ("warn" if self.findings else "pass")
        summary = (f"{self.updates} optimizer steps watched ({len(self.skips)} skipped), "
                   f"{len(self.checked)} update(s) checked against the fp32 reference")
        record["rungs"] = [{"id": RUNG, "status": status, "summary": summary,
                            "seconds": round(time.perf_counter() - self.started, 3)}]
        record["findings"] = [f.to_dict() for f in self.findings]
        record["watch"] = {"checked": self.checked, "skipped_steps": len(self.skips),
                           "every": self.every}
        record["notes"] = list(self.notes)
        record["seconds"] = round(time.perf_counter() - self.started, 3)
        from .record import exit_code
        record["exit_code"] = exit_code(record)
        return record


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
          accumulation_steps: int, scaler: Any = None, scheduler: Any = None,
          loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
          every: int = DEFAULT_EVERY, on_error: str = "warn", out: str | Path | None = None,
          name: str = "watched run") -> Watch:
    """The sentinel of a plain training loop: `with ampdoctor.watch(model, optimizer,
    scaler=scaler, accumulation_steps=K, loss_fn=...) as w:` around the loop, and `for batch
    in w.batches(loader):` for its micro-batches (module docstring, docs/watch.md)."""
    return Watch(model, optimizer, accumulation_steps=accumulation_steps, scaler=scaler,
                 scheduler=scheduler, loss_fn=loss_fn, every=every, on_error=on_error,
                 out=out, name=name)


def _built_at(obj: Any, frame: Any, finder: CallSiteFinder) -> Site | None:
    """Where the user's code built `obj`: in the first of the user's frames above `frame`
    that holds it in a variable, the line of the assignment to that variable (read with
    `ast` from the function's source)."""
    import ast
    import inspect
    while frame is not None:
        code = frame.f_code
        if not finder._classify(code.co_filename)[0]:
            names = {name for name, value in frame.f_locals.items() if value is obj}
            if names:
                with contextlib.suppress(OSError, TypeError, SyntaxError):
                    lines, start = inspect.getsourcelines(code)
                    start = max(start, 1)
                    import textwrap
                    tree = ast.parse(textwrap.dedent("".join(lines)))
                    for node in ast.walk(tree):
                        if isinstance(node, ast.Assign) and any(
                                isinstance(t, ast.Name) and t.id in names for t in node.targets):
                            return Site(code.co_filename, start + node.lineno - 1,
                                        code.co_name)
                return None
        frame = frame.f_back
    return None


def _precision_now(scaler: Any, params: list[torch.Tensor]) -> str:
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


def _device(params: list[torch.Tensor]) -> str:
    return str(params[0].device) if params else "cpu"


__all__ = ["Watch", "WatchError", "watch", "Location"]
