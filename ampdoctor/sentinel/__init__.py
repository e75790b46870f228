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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.enums import KindId
from ..core.findings import Finding, Location, Severity, location
from ..kinds.clipping import WatchedScaledClip, watched_scaled_clip
from ..probe.callsite import CallSiteFinder, Site
from .checks import COUNT_WINDOWS, RUNG, CountChecks, LossFn, Window, built_at
from .distributed import DistributedReplay, ranks_record, unwrap, writes_record
from .patching import Patching, direct_site
from .replay import device_of, precision_now

if TYPE_CHECKING:
    from ..record.model import RecordModel

#: optimizer steps between two expensive checks, by default
DEFAULT_EVERY = 500
#: the first window checked the expensive way (0-based): the second, so that a bug shows at
#: once while the first window's one-off effects (a scaler's first calibration) are past
FIRST_CHECKED_WINDOW = 1


class WatchError(AssertionError):
    """Raised from the training step with `on_error="raise"`: the finding is its message."""

    def __init__(self, finding: Finding):
        self.finding = finding
        loc = f" at {finding.location.file}:{finding.location.line}" if finding.location else ""
        super().__init__(f"ampdoctor watch: {finding.kind}{loc}: {finding.message}")


class Watch(CountChecks, DistributedReplay, Patching):
    """The sentinel of one training run (see the module docstring). Use it as a context
    manager around the loop; `batches(iterable)` hands the loop its micro-batches and keeps
    those of a checked window."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 accumulation_steps: int, scaler: Any = None, scheduler: Any = None,
                 loss_fn: LossFn | None = None,
                 every: int = DEFAULT_EVERY, on_error: str = "warn",
                 out: str | Path | None = None, name: str = "watched run"):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, not {accumulation_steps}")
        if every < 1:
            raise ValueError(f"every must be >= 1, not {every}")
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', not {on_error!r}")
        # the module and optimizer a DDP or Fabric wrapper holds are hooked and replayed (a
        # replay through DDP's forward would arm its reducer, Fabric's would autocast); under
        # DDP the ranks' references are averaged
        self.wrapper, self.wrapped_optimizer = model, optimizer
        self.model, self.optimizer, self.group = unwrap(model, optimizer)
        self.K = int(accumulation_steps)
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.every, self.on_error, self.out, self.name = every, on_error, out, name
        self.finder = CallSiteFinder()
        self.params = [p for g in optimizer.param_groups for p in g["params"]
                       if p.requires_grad]
        self.findings: list[Finding] = []
        self.window = Window()
        self.windows = 0                 # windows closed (optimizer steps and skips)
        self.updates = 0                 # real optimizer steps
        self.first_update_window: int | None = None   # the window of the first real update
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
        self.scaler_site = built_at(self.scaler, sys._getframe(1), self.finder) \
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
            # the second half of a clip split in two (accelerate's clip_grad_norm_ calls
            # get_total_norm, then this with the norm it got)
            if hasattr(owner, "clip_grads_with_norm_"):
                self._patch_attr(owner, "clip_grads_with_norm_",
                                 self._wrap_clip(owner.clip_grads_with_norm_, norm_given=True))
        for obj in {id(o): o for o in (self.optimizer, self.model, self.wrapper,
                                            self.wrapped_optimizer)}.values():
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
        record = self._make_record() if self.group is None \
            else ranks_record(self, gathered=exc[0] is None)
        # the user's copy: the record's JSON data, as the saved file has it (and where)
        self.record = record.dump()
        if self.out is not None and writes_record(self.group):
            from ..record import save
            self.record["path"] = str(save(record, Path(self.out)))

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
        w.precision = precision_now(self.scaler, self.params)

    def _site(self) -> Site | None:
        return self.finder.from_frame(sys._getframe(2))

    def _on_grad(self, param: torch.Tensor) -> None:
        key = id(param)
        self._fires[key] = self._fires.get(key, 0) + 1
        self.window.backwards = max(self.window.backwards, self._fires[key])

    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            w = watch.window
            # the line is read where a finding may name it (the first windows, a checked one):
            # a stack walk per backward is the sentinel's largest cheap cost
            if w.backward_site is None and (watch.windows < COUNT_WINDOWS or w.batches):
                w.backward_site = watch._site()
            return original(tensor, *args, **kwargs)
        return backward

    def _wrap_zero_grad(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            if watch._replaying:        # a replayed training_step's: the run's .grad stays
                return None
            w = watch.window
            if w.backwards:
                # the last zero_grad decides what the step keeps; the first names the line
                if w.zero_grad_after is None:
                    w.zero_grad_site = watch._site()
                w.zero_grad_after = w.backwards
            return original(*args, **kwargs)
        return zero_grad

    def _wrap_unscale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def unscale_(optimizer: Any) -> Any:
            if optimizer is watch.optimizer:
                watch.window.unscaled = True
            return original(optimizer)
        return unscale_

    def _wrap_clip(self, original: Callable[..., Any],
                   norm_given: bool = False) -> Callable[..., Any]:
        """`clip_grad_norm_(parameters, max_norm)`, which returns the norm, or (`norm_given`)
        `clip_grads_with_norm_(parameters, max_norm, total_norm)`, which is handed it."""
        watch = self

        def clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            parameters = list(parameters)
            result = original(parameters, max_norm, *args, **kwargs)
            norm = (args[0] if args else kwargs.get("total_norm")) if norm_given else result
            ours = {id(p) for p in watch.params}
            if norm is not None and any(id(p) in ours for p in parameters):
                watch._on_clip(norm, float(max_norm), watch._site())
            return result
        clip.__name__ = getattr(original, "__name__", "clip_grad_norm_")
        return clip

    def _on_clip(self, norm: Any, max_norm: float, site: Site | None) -> None:
        w = self.window
        w.clip_norm, w.clip_max = float(norm), max_norm
        if self.scaler is None or w.unscaled:
            return
        w.clip_scaled = True
        scale = float(self.scaler.get_scale())
        if scale == 1.0 or not math.isfinite(w.clip_norm):
            return
        self._found(watched_scaled_clip(WatchedScaledClip(
            RUNG, self.updates, w.clip_norm, scale, max_norm, location=location(site),
            framework=getattr(self, "framework", None))))

    def _wrap_scheduler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        def step(*args: Any, **kwargs: Any) -> Any:
            if watch._replaying:        # a replayed training_step's: the schedule stays
                return None
            w = watch.window
            w.scheduler_steps += 1
            # the line: a call the user's code makes itself over one a framework makes for it
            # (Lightning steps the scheduler after each optimizer step)
            # (past the sentinel's own frames: the class-level dispatch of `_patch_instance`)
            direct = direct_site(sys._getframe(1), watch.finder) is not None
            if w.scheduler_site is None or (direct and not w.scheduler_direct):
                w.scheduler_site, w.scheduler_direct = watch._site(), direct
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
    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        # torch hands the hook the step's arguments with the optimizer first
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._step_now()
            return None
        # `optimizer.step(closure)` (Lightning, LBFGS): the window's last backward runs in the
        # closure, inside the step: the step is judged when the closure returns (once)
        done: list[bool] = []

        def judged_closure() -> Any:
            result = closure()
            if not done:
                done.append(True)
                self._step_now()
            return result
        if "closure" in kwargs:
            return args, {**kwargs, "closure": judged_closure}
        return (args[0], judged_closure, *args[2:]), kwargs

    def _explained(self, w: Window) -> str | None:
        # one backward per step where K were meant: the replay of that one micro-batch shows
        # the loss's 1/K, which is the step count's consequence (judged after the first steps)
        if self.K > 1 and w.backwards == 1:
            return KindId.STEP_PER_MICROBATCH
        return super()._explained(w)

    def _step_now(self) -> None:
        if self._in_scaler_step:
            self._stepped_in_scaler = True
        if self.window.batches and self.window.backwards:
            self._pending = not self._check_update()
        if self.first_update_window is None:
            self.first_update_window = self.windows
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
        self.window = Window()
        self._fires.clear()
        self.windows += 1
        if stepped and self.skips and self.windows % 50 == 0:
            self._judge_skips()

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
        self._say(f"{text}: {finding.message}", finding)

    def _say(self, text: str, finding: Finding) -> None:
        """Tell the user of a finding (a framework's callback says it its framework's way)."""
        warnings.warn(text, stacklevel=5)

    def _make_record(self) -> RecordModel:
        from ..record.model import FindingModel, RungModel
        from ..runner import blank_record, environment
        errors = [f for f in self.findings if f.severity == Severity.ERROR]
        record = blank_record(spec=None, source={}, name=self.name, device=device_of(self.params),
                              accumulation_steps=self.K, optimizer_steps=self.updates,
                              micro_batch_size=None, environment=environment(None))
        record.verdict = "failed" if errors else "healthy"
        record.failed_rung = RUNG if errors else None
        status = "fail" if errors else ("warn" if self.findings else "pass")
        summary = (f"{self.updates} optimizer steps watched ({len(self.skips)} skipped), "
                   f"{len(self.checked)} update(s) checked against the fp32 reference")
        record.rungs = [RungModel(id=RUNG, status=status, summary=summary,
                                  seconds=round(time.perf_counter() - self.started, 3))]
        record.findings = [FindingModel.of(f) for f in self.findings]
        record.watch = {"checked": self.checked, "skipped_steps": len(self.skips),
                        "every": self.every}
        record.notes = list(self.notes)
        record.seconds = round(time.perf_counter() - self.started, 3)
        from ..record import exit_code
        record.exit_code = exit_code(record)
        return record



def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
          accumulation_steps: int, scaler: Any = None, scheduler: Any = None,
          loss_fn: LossFn | None = None,
          every: int = DEFAULT_EVERY, on_error: str = "warn", out: str | Path | None = None,
          name: str = "watched run") -> Watch:
    """The sentinel of a plain training loop: `with ampdoctor.watch(model, optimizer,
    scaler=scaler, accumulation_steps=K, loss_fn=...) as w:` around the loop, and `for batch
    in w.batches(loader):` for its micro-batches (module docstring, docs/watch.md)."""
    return Watch(model, optimizer, accumulation_steps=accumulation_steps, scaler=scaler,
                 scheduler=scheduler, loss_fn=loss_fn, every=every, on_error=on_error,
                 out=out, name=name)



__all__ = ["Watch", "WatchError", "watch", "Location"]
