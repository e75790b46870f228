"""One run of the user's script, inside the child process that runs it (`spawn` starts it).

The script runs as `__main__` (`runpy.run_path`, `sys.argv = [script, *args]`, its folder first
on `sys.path`, the caller's working directory) with the probe recording and these switches:

- every autocast it builds is forced to the run's precision (fp32: disabled; bf16/fp16: that
  dtype, enabled) and every GradScaler is forced off (fp32, bf16) or on (fp16);
- the model is found when an optimizer is built (the modules that hold its parameters), and
  each top-level forward of it with gradients enabled is one micro-batch: its input rows are
  digested (`align`), and the probe is told it consumed the next micro-batch;
- the run stops (`StopScript`, caught at the runpy boundary) at the first such forward once
  `steps` windows have ended (a scaler.step or a direct optimizer.step of the first optimizer)
  and `min_samples` input rows were consumed;
- `teacher`: at the first forward of window g the model's weights are set to `teacher[g]` (the
  run under test's weights at its step g); `reference`: each window's gradient is kept as it
  stands before any clip or step touches it (the fp32 reference's unclipped gradient);
- the script's file writes go to the run's scratch folder (`files`: its checkpoints, logs
  and removals behave as they do plainly, and no file outside the scratch changes); the
  scratch is removed when the run ends, the outcome says what was written and removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import runpy
import shutil
import sys
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core import processes
from ..probe import frameworks, patches, recorder, spill, wrappers
from ..probe.callsite import CallSiteFinder, Site
from ..probe.events import Event, OptimizerStep, ScalerStep, Snapshot, StepRecord
from ..probe.observer import ProbeSettings
from ..probe.trace import WeightCast, weight_cast
from . import constants, deepspeed, expectation, files, forcing, prefork


@dataclass
class Job:
    """What one child run does (pickled to the child)."""

    script: str
    args: list[str]
    precision: str
    steps: int
    cwd: str
    env: dict[str, str]
    min_samples: int = 0
    teacher: list[Mapping[str, torch.Tensor]] | None = None
    reference: bool = False
    #: stop at the first window past the teacher's states (False: go on from there untouched)
    stop_after_teacher: bool = True
    #: (window, K, backwards per window): an inf written into one gradient of that window
    inject: tuple[int, int, int] | None = None
    #: every norm clip of the script clips at this threshold instead of its own (clip-space)
    clip_at: float | None = None
    #: stop anyway after this many micro-batch forwards (a script that never steps)
    max_forwards: int = 10_000
    #: the run's scratch folder (`files.Overlay`); None: a temp dir of the child's own
    scratch: str | None = None
    #: a reference's DeepSpeed config keys (K = 1, the batch K x b: `script.deepspeed`)
    deepspeed: dict[str, Any] | None = None
    #: literals of the script changed in this run: (role, name, line, column, value)
    #: (`script.constants`: a reference whose K and micro-batch are written in the script)
    rewrites: list[tuple[str, str, int, int, int]] | None = None


@dataclass
class ForwardInput:
    """One micro-batch forward: its rows (first dimension of its first tensor), per tensor
    argument in order the digest of each row, and the window it belongs to. A 0-d tensor
    argument (a scalar, such as a count of the window's tokens) has no rows and is left out."""

    rows: int
    digests: list[list[str]]
    window: int = 0


@dataclass
class Outcome:
    """What one child run sends back (pickled)."""

    events: list[Event] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    backward_count: int = 0
    random_site: Site | None = None
    param_names: dict[int, str] = field(default_factory=dict)
    owners: dict[int, int] = field(default_factory=dict)
    param_shapes: dict[str, torch.Size] = field(default_factory=dict)
    initial_state: Mapping[str, torch.Tensor] | None = None
    forwards: list[ForwardInput] = field(default_factory=list)
    models: list[dict[str, Any]] = field(default_factory=list)
    optimizers: list[dict[str, Any]] = field(default_factory=list)
    scalers: list[dict[str, Any]] = field(default_factory=list)
    autocasts: list[dict[str, Any]] = field(default_factory=list)
    device: str = "cpu"
    #: how the script ended: "stopped" (after its steps), "finished", "exit N", "raised"
    ended: str = "finished"
    error: dict[str, Any] | None = None
    ref_grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    cast: WeightCast | None = None
    injected: dict[str, Any] | None = None
    dropout: list[str] = field(default_factory=list)
    #: the random draws of the model's forward that took their expected values
    #: (`expectation`): "file:line name" of the first few
    expected_draws: list[str] = field(default_factory=list)
    #: the model's modules that normalised over the batch (BatchNorm in training mode) at its
    #: first micro-batch forward: their statistics are the micro-batch's own
    batch_stats: list[str] = field(default_factory=list)
    #: the script's writes: {"scratch": folder, "written": [path], "hidden": [path]}
    files: dict[str, Any] = field(default_factory=dict)
    #: backward n (1-based, the run's order) -> the optimizer slots whose parameters it gave
    #: gradients (a GAN's two losses train two models)
    backward_slots: dict[int, set[int]] = field(default_factory=dict)
    #: "file:line" of each torch.compile call, left eager (`forcing`)
    compiled: list[str] = field(default_factory=list)
    #: "file:line" of each `init_process_group` that formed a group of one (`forcing`)
    group_of_one: list[str] = field(default_factory=list)
    peak_rss: int = 0    #: its peak resident memory in bytes, 0 unknown (set by `spawn`)

    def micro_batches(self) -> int:
        """The micro-batches of the run's first window: its backwards before the first
        optimizer step, and its model's forwards there when fewer (a GAN's generator runs once
        per micro-batch, each of its two losses backward: two backwards, one micro-batch)."""
        if not self.steps:
            return 0
        forwards = sum(1 for f in self.forwards if f.window == 0)
        backwards = self.steps[0].backwards
        return min(backwards, forwards) if forwards else backwards


#: the stopped run's exception, kept with its traceback (see `run`)
_STOPPED: list[BaseException] = []


class StopScript(BaseException):
    """Raised inside the script at the forward after its last window: the run has given what
    it was for. A BaseException, so the script's own `except Exception` lets it through."""


def _row_digests(t: torch.Tensor) -> list[str]:
    data = t.detach().to("cpu").contiguous()
    rows = data.reshape(data.shape[0], -1)
    raw = rows.view(torch.uint8) if rows.numel() else rows.to(torch.uint8)
    arr = raw.numpy()
    return [hashlib.blake2b(arr[i].tobytes(), digest_size=12).hexdigest()
            for i in range(arr.shape[0])]


def _tensors(value: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif depth < 6 and isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, out, depth + 1)
    elif depth < 6 and isinstance(value, dict):
        for item in value.values():
            _tensors(item, out, depth + 1)
    return out


def _host(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.detach().to("cpu", torch.float32, copy=True)


class ScriptProbe:
    """The switches and bookkeeping of one child run around the probe (module docstring)."""

    def __init__(self, job: Job, finder: CallSiteFinder):
        self.job = job
        self.finder = finder
        self.probe = recorder.Probe(finder)
        self.out = Outcome()
        self.expectation = expectation.Expectation(finder)
        self.modules: list[tuple[weakref.ref, Site | None]] = []
        self.roots: list[torch.nn.Module] = []
        self.model: torch.nn.Module | None = None
        self.hooked: set[int] = set()
        self.depth = 0                # model forwards under way (the outermost is a micro-batch)
        self.seen_events = 0
        self.windows = 0              # windows ended (scaler.step / direct step of slot 0)
        self.samples = 0
        self.loaded = -1              # the teacher state last loaded
        self.captured = -1            # the window whose reference gradient was kept
        self.current = 0              # the window of the last micro-batch forward
        self.engine: Any = None       # the DeepSpeed engine the script built, if any

    def engine_built(self, engine: Any) -> None:
        self.engine = engine

    # --- the model -----------------------------------------------------------------------
    def module_built(self, module: torch.nn.Module) -> None:
        self.modules.append((weakref.ref(module), self._built_at(sys._getframe(1))))

    def _built_at(self, frame: Any) -> Site | None:
        """The user's line that built a module: the first frame of the user's code outside an
        `__init__` (a model class's own `super().__init__()` is not where the model is built)."""
        here = frame
        while here is not None:
            library, _ = self.finder._classify(here.f_code.co_filename)
            if not library and here.f_code.co_name != "__init__":
                return Site(os.path.realpath(here.f_code.co_filename), here.f_lineno,
                            here.f_code.co_name)
            here = here.f_back
        return self.finder.from_frame(frame)

    def optimizer_built(self, optimizer: torch.optim.Optimizer) -> None:
        slot = self.probe.optimizer_slot(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for param in params:
            if isinstance(param, torch.Tensor) and param.requires_grad:
                param.register_post_accumulate_grad_hook(
                    lambda _p, slot=slot: self.out.backward_slots.setdefault(
                        self.probe.backward_count, set()).add(slot))
        self.out.optimizers.append({
            "type": type(optimizer).__name__, "slot": slot,
            "params": sum(p.numel() for p in params),
            "site": self.finder.from_frame(sys._getframe(1))})
        wanted = {id(p) for p in params} - {id(p) for m in self.roots for p in m.parameters()}
        candidates: list[Any] = []
        for ref, site in self.modules:
            module = ref()
            if module is not None:
                owned = {id(p) for p in module.parameters()}
                if owned & wanted:
                    candidates.append((len(owned & wanted), len(owned), module, site))
        while wanted and candidates:
            candidates.sort(key=lambda c: (-len({id(p) for p in c[2].parameters()} & wanted),
                                           -c[1]))
            _, _, module, site = candidates.pop(0)
            covered = {id(p) for p in module.parameters()} & wanted
            if not covered:
                break
            wanted -= covered
            self.roots.append(module)
            self.out.models.append({"type": type(module).__name__, "site": site,
                                    "params": sum(p.numel() for p in module.parameters()
                                                  if p.requires_grad)})
        if not self.roots:
            return
        self.model = (self.roots[0] if len(self.roots) == 1 else
                      torch.nn.ModuleDict({f"m{i}": m for i, m in enumerate(self.roots)}))
        self.probe.model = self.model
        self.probe.param_names = {id(p): n for n, p in self.model.named_parameters()}
        # the first model's micro-batch forward: its own, or that of a module holding the same
        # parameters when the script calls that one instead (a LightningModule whose
        # training_step calls `self.net(x)`), the outermost one where one calls the other
        first = self.roots[0]
        same = {id(p) for p in first.parameters()}
        for module in [first] + [c[2] for c in candidates
                                 if {id(p) for p in c[2].parameters()} == same]:
            if id(module) not in self.hooked:
                self.hooked.add(id(module))
                module.register_forward_pre_hook(self._outer_forward, with_kwargs=True)
                module.register_forward_hook(self._forward_done, always_call=True)
        for root in self.roots:
            self.expectation.track(root)

    # --- each micro-batch forward ---------------------------------------------------------
    def _outer_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self.depth += 1
        if self.depth == 1:
            self.on_forward(module, args, kwargs)

    def _forward_done(self, *_: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def _count_windows(self) -> None:
        events = self.probe.events
        for event in events[self.seen_events:]:
            ended = (isinstance(event, ScalerStep)
                     or (isinstance(event, OptimizerStep) and not event.via_scaler))
            if ended and getattr(event, "optimizer", None) == 0:
                self.windows += 1
        self.seen_events = len(events)

    def on_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled() or recorder.ACTIVE is not self.probe:
            return
        self._count_windows()
        job = self.job
        if self.windows >= job.steps and self.samples >= job.min_samples:
            raise StopScript
        if len(self.out.forwards) >= job.max_forwards:
            raise StopScript
        teacher = job.teacher
        if teacher is not None and self.windows != self.loaded and (
                self.windows < len(teacher) or job.stop_after_teacher):
            if self.windows >= len(teacher):
                raise StopScript
            self.loaded = self.windows
            assert self.model is not None
            self._load(teacher[self.windows])
        self.current = self.windows
        # a 0-d tensor (a count such as transformers' `num_items_in_batch`) holds no rows: each
        # of the run's K forwards gets the window's count, the reference's one forward gets it
        # once, so as "rows" it would never line up with the run's (`windows.align`)
        tensors = [t for t in _tensors((args, kwargs), []) if t.dim()]
        rows = int(tensors[0].shape[0]) if tensors else 1
        self.samples += rows
        if not self.out.forwards and self.model is not None:
            self.out.batch_stats = [
                f"{n or '(model)'} ({type(m).__name__})" for n, m in self.model.named_modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
        self.out.forwards.append(ForwardInput(rows, [_row_digests(t) for t in tensors],
                                              self.windows))
        index = len(self.out.forwards) - 1
        self.probe.on_microbatch(index)
        self.probe.on_forward(index)

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        """The teacher's weights into the model, and into the masters a DeepSpeed engine's
        optimizer steps (a ZeRO-3 module's partitioned parameters only there)."""
        assert self.model is not None
        if self.engine is not None:
            from ..probe.deepspeed import load_weights
            load_weights(self.engine, self.model, state)
        shapes = {n: p.shape for n, p in self.model.named_parameters()
                  if getattr(p, "ds_tensor", None) is None}
        own = {k: v for k, v in state.items() if k in shapes or
               k not in dict(self.model.named_parameters())}
        with torch.no_grad():
            self.model.load_state_dict(own, strict=False)

    # --- the reference's unclipped gradient -------------------------------------------------
    def keep_reference(self) -> None:
        if not self.job.reference or self.model is None:
            return
        if self.captured == self.current:
            return
        self.captured = self.current
        grads = {n: _host(p.grad) for n, p in self.model.named_parameters()}
        while len(self.out.ref_grads) < self.current:
            self.out.ref_grads.append({})
        self.out.ref_grads.append(grads)


def run(job: Job) -> Outcome:
    """Run the script once as `job` says, in this (child) process; what it did."""
    spill.SPILL_BYTES = 1 << 62   # everything goes back through the pipe, nothing to disk
    prefork.plain_start_method()
    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    script = os.path.abspath(job.script)
    folder = os.path.dirname(script)
    sys.argv = [job.script, *job.args]
    sys.path.insert(0, folder)
    finder = CallSiteFinder([Path(folder)])
    probe = ScriptProbe(job, finder)
    out = probe.out
    prefork.import_frameworks(script, job.cwd)
    overlay = files.Overlay(job.scratch or tempfile.mkdtemp(prefix="ampdoctor-run-",
                                                              dir=processes.temp_root()))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, overlay.root, True)
        patched = stack.enter_context(patches.installed(wrappers.install)).patched
        # the frameworks the script's imports preloaded (accelerate, transformers, Lightning):
        # who divides by K and where the loss was computed, as in a spec's run
        patched += stack.enter_context(patches.installed(frameworks.install)).patched
        patched += stack.enter_context(
            patches.installed(lambda p: files.install(overlay, p))).patched
        patched += stack.enter_context(
            patches.installed(lambda p: forcing.install(probe, p))).patched
        patched += stack.enter_context(
            patches.installed(lambda p: deepspeed.install(probe, p))).patched
        patched += stack.enter_context(
            patches.installed(lambda p: expectation.install(probe.expectation, p))).patched
        # a preloaded library's own copy of a patched function points at the patched one
        prefork.rebind(patched)
        stack.enter_context(recorder.observing(ProbeSettings(dropout_off=True)))
        if job.inject is not None:
            from ..probe.inject import OverflowInjector
            injector = OverflowInjector(*job.inject)
            probe.probe.before_backward = injector
        recorder.activate(probe.probe)
        try:
            if job.rewrites:    # the reference of literals written in the script
                constants.run_as_main(script, job.rewrites)
            else:
                runpy.run_path(script, run_name="__main__")
        except StopScript as exc:
            out.ended = "stopped"
            # The stopped script's frames stay alive until this process exits (os._exit, no
            # cleanup): a DataLoader iterator they hold would otherwise wait for its worker
            # processes to shut down (seconds each) before the run can report.
            _STOPPED.append(exc)
        except SystemExit as exc:
            out.ended = f"exit {exc.code if exc.code is not None else 0!r}"
            if exc.code not in (None, 0):
                out.error = _run_error(exc, finder)
        except BaseException as exc:  # noqa: BLE001 - the script's failure, recorded
            out.ended = "raised"
            out.error = _run_error(exc, finder)
        finally:
            recorder.activate(None)
        if job.inject is not None:
            out.injected = {"fired": injector.fired, "param": injector.param_name}
        out.files = overlay.report(job.cwd)
    return _finish(probe)


def _finish(probe: ScriptProbe) -> Outcome:
    p, out = probe.probe, probe.out
    out.events = list(p.events)
    out.steps = list(p.steps)
    out.snapshots = dict(p.snapshots)
    out.backward_count = p.backward_count
    out.expected_draws = list(probe.expectation.sites)
    out.random_site = p.random_site
    model = probe.model
    if model is not None:
        out.param_names = {id(prm): n for n, prm in model.named_parameters()}
        out.owners = {id(prm): slot for slot, opt in enumerate(p.optimizers)
                      for g in opt.param_groups for prm in g["params"]}
        # (a ZeRO-3 parameter is partitioned: its whole shape is `ds_shape`)
        out.param_shapes = {n: getattr(prm, "ds_shape", prm.shape)
                            for n, prm in model.named_parameters()}
        first = next(iter(model.parameters()), None)
        out.device = str(first.device) if first is not None else "cpu"
        out.cast = weight_cast(model, [])
        out.dropout = [f"{n or '(model)'} ({type(m).__name__}, p={m.p:g})"
                       for n, m in model.named_modules()
                       if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    for step in out.steps:   # plain dicts of host tensors (a spilled mapping stays behind)
        step.grads = {k: _host(v) for k, v in step.grads.items()}
    out.snapshots = {g: Snapshot(s.group, {k: v.detach().to("cpu", copy=True)
                                           for k, v in s.state.items()}, s.training)
                     for g, s in out.snapshots.items()}
    if out.snapshots:
        out.initial_state = out.snapshots[min(out.snapshots)].state   # the same object
    return out


def _run_error(exc: BaseException, finder: CallSiteFinder) -> dict[str, Any]:
    """`refused.run_error`, imported only here: it imports the rules and the spec (pydantic),
    0.35 s of the fork server's start-up that a run which ends well never needs."""
    from .refused import run_error
    return run_error(exc, finder)
