"""The runs of one script-mode diagnose: each precision's run of the script (a child process
each, `spawn`), what came back as a Trace (`ScriptTrace`), and the fp32 reference, the script
run with `--reference-args` teacher-forced to each run's weights (`ScriptSession.reference`).

`ScriptSession` offers what the judge and the rules read of a spec-mode `Session` (K, N, the
windows, the parameter names and shapes, `reference(window, state)`, the traces), so a script's
steps are judged and explained by the same code as a spec's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..core.errors import UsageError, UserCodeError
from ..probe.callsite import CallSiteFinder
from ..probe.events import Backward, Clip, EngineBuilt
from ..probe.trace import Trace
from ..reference import WindowReference
from . import windows
from .ahead import Runs, early_overlap_refused, overlap_refused, reference_of, same_weights
from .child import Job, Outcome
from .command import Command, ScriptCode, ScriptSpec
from .references import deferred, window_reference
from .refused import (
    arguments_refused,
    failed_first,
    one_process,
    reference_batch_refused,
    reference_model_refused,
    where,
)
from .refused import refused as _refused
from .replay import ScriptTrace, replay
from .scratch import Scratch


class ScriptSession:
    """The runs of one script-mode diagnose (module docstring)."""

    def __init__(self, command: Command):
        self.command = command
        self.script = os.path.abspath(os.path.join(command.cwd, command.script))
        self.finder = CallSiteFinder([Path(self.script).parent])
        self.spec = ScriptSpec(self.script, optimizer_steps=command.steps,
                               timeout_s=command.timeout_s)
        self.code = ScriptCode(self.script)
        self.N = command.steps
        self.K = 1
        self.traces: dict[str, ScriptTrace] = {}
        self.notes: set[str] = set()
        #: the reference's windows in the run's micro-batches (`windows.align`), once known
        self.bounds: tuple[int, ...] | None = None
        self.charts: list[dict[str, Any]] = []
        self.step_observer_for = None
        self.injected: Any = None
        self.reference_repeatable = False
        self.device = torch.device("cpu")
        self.param_shapes: dict[str, torch.Size] = {}
        self.param_order: list[str] = []
        self.initial_state: Mapping[str, torch.Tensor] = {}
        #: rows of the reference's first window (its batch, K x b), when it ran
        self.reference_rows = 0
        self.reference_probe: Outcome | None = None
        #: the whole-window reference run of the fp32 run's windows (teacher-forced)
        self.window_reference: Outcome | None = None
        #: why the reference cannot be used (None: it can, or was not asked for)
        self.unaligned: str | None = None
        self._refs: dict[tuple[int, int], dict[str, torch.Tensor | None]] = {}
        self.per_mb_cache: dict[tuple[int, int], Any] = {}
        #: a DeepSpeed script's reference engine config keys (`references.deferred`)
        self.deepspeed_reference: dict[str, Any] | None = None
        self._pinned: list[Any] = []
        #: where the script's file writes land: a folder per run (`scratch`, `files`)
        self.scratch = Scratch()
        #: the runs (`Runs`: each run's captured output in the order the ladder read them),
        #: and which runs to start ahead of the ladder once the fp32 run is back (`rungs.ahead`)
        self.runs = Runs(command, self.scratch)
        self.runs.ahead.follow_with(self.follow_ups)
        self.outputs = self.runs.outputs
        self.plan: Callable[[ScriptSession], list[str]] | None = None
        #: the runs of a precision started ahead, read once they ended (None: not to be
        #: followed: it failed), with their references queued (`follow_ups`)
        self._read_ahead: dict[str, ScriptTrace | None] = {}

    # --- running the script ---------------------------------------------------------------
    def job(self, precision: str, *, reference: bool = False, **extra: Any) -> Job:
        cmd = self.command
        args = cmd.reference_args if reference else cmd.args
        assert args is not None
        if reference and self.deepspeed_reference is not None:
            extra.setdefault("deepspeed", dict(self.deepspeed_reference))
        if reference and cmd.reference_rewrites:
            extra.setdefault("rewrites", list(cmd.reference_rewrites))
        return Job(script=self.script, args=list(args), precision=precision,
                   steps=extra.pop("steps", self.N), cwd=cmd.cwd, env=dict(cmd.env),
                   reference=reference, **extra)

    def run(self, job: Job, what: str, ahead: str | None = None) -> Outcome:
        """One run of the script (`Runs.run`); what it wrote noted."""
        outcome = self.runs.run(job, what, ahead)
        self.notes = self.scratch.absorb(outcome.files, self.notes)
        return outcome

    def start(self) -> ScriptTrace:
        """The fp32 run (first the reference's first window, if any, for K x b)."""
        one_process(self.command.env, self.script)
        if self.command.reference_args is None and self.command.defer_batch is not None:
            self.command.reference_args = deferred(self, self.command.defer_batch)
        if self.command.reference_args is not None:
            cmd_args = self.command.reference_args
            # the fp32 run beside the reference's first: it needs the reference's rows only
            # where they outnumber the run's windows (then it is run again, `_fp32_run`)
            self.runs.allow_overlap(early_overlap_refused(self.script))
            self.runs.ahead.plan([("fp32", self.job("fp32"), "fp32 run")])
            first = self.run(self.job("fp32", reference=True, steps=1), "reference run")
            self.reference_probe = first
            if first.error is not None:
                _refused(first)
                arguments_refused(first, self.outputs[-1]["text"] if self.outputs else "",
                                  self.command.args, cmd_args)
                failed_first(self, first, cmd_args)
            window0 = [f for f in first.forwards if f.window == 0]
            self.reference_rows = sum(f.rows for f in window0)
            accumulated = first.micro_batches()
            if accumulated > 1:
                raise UsageError(
                    f"--reference-args: the reference run accumulated {accumulated} "
                    "micro-batches (forwards and backwards) before its first optimizer step; "
                    "the reference must take one micro-batch per optimizer step (K = 1) "
                    "holding the whole step's data: set the script's accumulation option to 1")
        outcome = self._fp32_run()
        if outcome.error is not None and not outcome.steps:
            _refused(outcome)
        reference_model_refused(self.reference_probe, outcome)
        if outcome.param_shapes:
            self.param_shapes = dict(outcome.param_shapes)
            self.param_order = list(outcome.param_shapes)
        self.device = torch.device(outcome.device)
        self.initial_state = outcome.initial_state or {}
        self.K = self._accumulation(outcome)
        reference_batch_refused(self.reference_rows, outcome)
        b = outcome.forwards[0].rows if outcome.forwards else None
        clips = [e.max_norm for e in outcome.events
                 if isinstance(e, Clip) and e.max_norm is not None]
        self.spec.max_grad_norm = clips[0] if clips else None
        self.spec.micro_batch_size = b
        self.spec.accumulation_steps = self.K
        self.spec.config_files = sorted({e.config_file for e in outcome.events
                                         if isinstance(e, EngineBuilt) and e.config_file}
                                        | set(self.config_arguments()))
        trace = replay(outcome, "fp32", self.K, self.finder, None)
        self.traces["fp32"] = trace
        if outcome.steps and outcome.error is None:
            self._run_ahead(outcome)
            self.prepare_references(trace)   # (and whether the reference reads the same data)
            self.follow_ups()                # (the windows are known from here)
        return trace

    def _fp32_run(self) -> Outcome:
        """The fp32 run, over at least the reference's rows of N windows; started beside the
        reference's first run (without that bound), run again where it read fewer."""
        job = self.job("fp32", min_samples=self.N * self.reference_rows)
        ahead = "fp32" in self.runs.ahead.queue
        outcome = self.run(job, "fp32 run", ahead="fp32")
        read = sum(f.rows for f in outcome.forwards)
        if ahead and outcome.error is None and read < job.min_samples:
            outcome = self.run(job, "fp32 run")
        return outcome

    def _run_ahead(self, outcome: Outcome) -> None:
        """Queue the runs the ladder will ask for that need only the fp32 run (`plan`), to
        overlap the ones it waits for, where the script allows it (`ahead`)."""
        if self.plan is None or not self.runs.allow_overlap(
                overlap_refused(outcome, self.reference_probe)):
            return
        jobs = {"repeat": lambda: (self.repeat_job(), "repeat fp32 run"),
                "bf16": lambda: (self.precision_job("bf16"), "bf16 run"),
                "fp16": lambda: (self.precision_job("fp16"), "fp16 run")}
        # the longest chain first: the fp16 run is followed by its reference, the injected
        # overflow's run and that run's reference; the repeat by nothing
        order = ("fp16", "bf16", "repeat")
        names = sorted((n for n in self.plan(self) if n in jobs), key=order.index)
        self.runs.ahead.plan([(name, *jobs[name]()) for name in names])

    def follow_ups(self) -> None:
        """A precision's run started ahead that has ended: read now (`_read`), and the
        reference run teacher-forced to its weights queued ahead of the rest, so that it runs
        while the ladder is still elsewhere. Only once the reference's windows are known (the
        fp32 run's references prepared) and where the run gave steps to compare; a reference
        queued before the reference was found unusable (`unaligned`) is stopped."""
        if not self.has_reference:
            for precision in ("fp16", "bf16"):
                self.runs.ahead.drop(reference_of(precision))
            return
        if self.bounds is None:
            return
        for precision in ("fp16", "bf16"):
            run = self.runs.ahead.finished(precision)
            if run is None or precision in self._read_ahead:
                continue
            self._read_ahead[precision] = None    # (a run that failed: the ladder says why)
            try:
                outcome = run.wait()
                if outcome.error is not None or not outcome.steps:
                    continue
                trace = self._read(outcome, precision, None)
                states = self.teacher_states(trace)
            except Exception:  # noqa: BLE001 - read again when the ladder asks, and said then
                continue
            self._read_ahead[precision] = trace
            if states:
                self.runs.ahead.plan([(reference_of(precision), self._reference_job(states),
                                       "reference run")], first=True)

    def repeat_job(self) -> Job:
        """The reproducibility rung's second fp32 run: its first window, from the same
        weights."""
        return self.job("fp32", steps=1, teacher=[self.initial_state], stop_after_teacher=False,
                        min_samples=self.reference_rows)

    def config_arguments(self) -> list[str]:
        """The config files among the script's arguments (`--deepspeed ds_config.json` handed
        to a Trainer, which builds the engine from a mapping): searched with the script."""
        found = []
        for arg in self.command.args:
            path = os.path.join(self.command.cwd, arg.split("=", 1)[-1])
            if path.endswith((".json", ".yaml", ".yml")) and os.path.isfile(path):
                found.append(os.path.abspath(path))
        return found

    def _accumulation(self, outcome: Outcome) -> int:
        """K: the reference's window over the run's micro-batch when the reference ran (what
        the script means), else the backwards before the run's first optimizer step."""
        b = outcome.forwards[0].rows if outcome.forwards else 0
        if self.reference_rows and b and self.reference_rows % b == 0:
            return self.reference_rows // b
        return max(1, outcome.micro_batches())

    def trace(self, precision: str) -> ScriptTrace:
        """The run of `precision` (fp32 first, see `start`), started from the fp32 run's initial
        weights; run once and cached."""
        if precision not in self.traces:
            self.traces[precision] = self.fresh_run(precision)
        return self.traces[precision]

    def fresh_run(self, precision: str, inject: Any = None,
                  clip_at: float | None = None) -> ScriptTrace:
        """Another run of `precision` from the fp32 run's initial weights (the first window's
        forward loads them), its references prepared when there is a reference."""
        self.follow_ups()
        job = self.precision_job(precision, inject, clip_at)
        plain = inject is None and clip_at is None
        outcome = self.run(job, f"{precision} run", ahead=precision if plain else None)
        read = self._read_ahead.pop(precision, None) if plain else None
        trace = (read if read is not None and read.outcome is outcome
                 else self._read(outcome, precision, clip_at))
        if inject is not None and outcome.injected is not None:
            inject.fired = bool(outcome.injected.get("fired"))
            inject.param_name = outcome.injected.get("param")
        if self.has_reference:
            self.prepare_references(trace, reference_of(precision) if plain else None)
        return trace

    def _read(self, outcome: Outcome, precision: str, clip_at: float | None) -> ScriptTrace:
        """A run of `precision` (not the fp32 run) as a trace, in the reference's windows."""
        trace = replay(outcome, precision, self.K, self.finder, clip_at)
        trace.bounds = self.bounds
        fp32 = self.traces.get("fp32")
        if fp32 is not None and not _same_first_input(fp32.outcome, outcome):
            # the first loss of the two runs is not the same computation: no second scale
            # can be read from their ratio (`rules.scale_state.runtime_double_scaling`)
            trace.probe.events = [replace(e, value=None) if isinstance(e, Backward) else e
                                  for e in trace.probe.events]
        return trace

    def precision_job(self, precision: str, inject: Any = None,
                      clip_at: float | None = None) -> Job:
        """A run of `precision` from the fp32 run's initial weights (`fresh_run`)."""
        return self.job(precision, min_samples=self.N * self.reference_rows,
                        teacher=[self.initial_state] if self.initial_state else None,
                        stop_after_teacher=False,
                        inject=None if inject is None else (inject.window, inject.K,
                                                            _per_window(inject)),
                        clip_at=clip_at)

    def run_loop(self, precision: str, *, before_backward: Any = None,
                 step_sink: Any = None, max_grad_norm: Any = "spec", **extra: Any) -> Trace:
        """What a spec-mode rung asks of `Session.run_loop`, where a script can give it: another
        plain run of a precision, with an overflow injected (`probe.inject.OverflowInjector`),
        its steps handed to `step_sink` after the run. A re-split window or another clip
        threshold cannot be asked of a script: a run that raised NotImplementedError."""
        unsupported = {k for k, v in extra.items()
                       if v is not None and k not in ("rng_seed", "judge_as_it_runs", "capture")}
        if unsupported or not (max_grad_norm == "spec" or isinstance(max_grad_norm, float)):
            trace = replay(Outcome(), precision, self.K, self.finder, None)
            trace.error = NotImplementedError("script mode runs the script as it is")
            return trace
        trace = self.fresh_run(precision, inject=before_backward,
                               clip_at=None if max_grad_norm == "spec" else max_grad_norm)
        if step_sink is not None:
            for step in trace.steps:
                if step_sink(step):
                    break
        return trace

    # --- the reference --------------------------------------------------------------------
    @property
    def has_reference(self) -> bool:
        return self.command.reference_args is not None and self.unaligned is None

    def teacher_states(self, trace: ScriptTrace) -> list[tuple[Mapping[str, torch.Tensor], int]]:
        """Per window, the weights the run saw at its first step there, and that step's group;
        a window without a step takes the weights of the one before."""
        first: dict[int, int] = {}
        for ordinal, step in enumerate(trace.steps):
            window = self.window_of(step, ordinal, trace)
            first.setdefault(window, step.group)
        states: list[tuple[Mapping[str, torch.Tensor], int]] = []
        for window in range(self.N):
            group = first.get(window)
            snap = trace.snapshots.get(group) if group is not None else None
            if snap is not None:
                states.append((snap.state, group if group is not None else -1))
            elif states:
                states.append((states[-1][0], -1))
            elif self.initial_state:
                states.append((self.initial_state, -1))
        return states

    def prepare_references(self, trace: ScriptTrace, ahead: str | None = None) -> None:
        """One reference run for every window of `trace`, teacher-forced to its weights (the
        one queued ahead under `ahead`, if any); the first (fp32) one also checks that the
        reference reads the run's data."""
        states = self.teacher_states(trace)
        if not states or self.command.reference_args is None:
            return
        ref = self._teacher_forced(states, ahead)
        if trace.precision == "fp32":
            self.window_reference = ref
            unaligned, bounds = windows.align(trace.outcome.forwards, ref.forwards, self.N)
            self.unaligned = self.unaligned or unaligned
            if self.unaligned is None and self.bounds is None:
                self.bounds = trace.bounds = bounds
                again = self.teacher_states(trace)
                if [g for _, g in again] != [g for _, g in states]:
                    # a short window moved the steps' windows: teacher-force them anew
                    states = again
                    ref = self.window_reference = self._teacher_forced(states)
        for window, (state, group) in enumerate(states):
            # (a window without a step borrowed the weights before it: not its reference)
            if group >= 0 and window < len(ref.ref_grads) and ref.ref_grads[window]:
                self._refs[(id(state), window)] = ref.ref_grads[window]
                self._pinned.append(state)

    def _reference_job(self, states: list[tuple[Mapping[str, torch.Tensor], int]]) -> Job:
        return self.job("fp32", reference=True, steps=len(states),
                        teacher=[s for s, _ in states])

    def _teacher_forced(self, states: list[tuple[Mapping[str, torch.Tensor], int]],
                        ahead: str | None = None) -> Outcome:
        """The reference run, each window teacher-forced to its weights in `states`: the one
        queued ahead under `ahead` (`follow_ups`) when it was queued for these very weights."""
        job = self._reference_job(states)
        queue = self.runs.ahead.queue
        if ahead in queue and not same_weights(queue[ahead].job, job):
            self.runs.ahead.drop(ahead)
        ref = self.run(job, "reference run", ahead=ahead)
        if ref.error is not None:
            raise UserCodeError(
                "the script run with --reference-args (the fp32 reference) raised: "
                f"{ref.error.get('text')}", location=where(ref.error))
        return ref

    def reference(self, window: int, state: Mapping[str, torch.Tensor] | None = None,
                  training: bool = True, per_mb: bool = False, weighting: Any = None,
                  rng_seed: int | None = None, **_: Any) -> WindowReference:
        """The fp32 reference gradient of `window` at `state` (unclipped): from the reference
        run teacher-forced to that run's weights, else one run of its own."""
        state = state if state is not None else self.initial_state
        if not self.has_reference:   # nothing to read it from: no gradient (norm 0)
            return WindowReference(full=dict.fromkeys(self.param_order), per_mb=None,
                                   counts=None, weighted=False, mode="loop")
        grads = None if rng_seed is not None else self._refs.get((id(state), window))
        if grads is None:
            ref = self.run(self.job("fp32", reference=True, steps=window + 1,
                                    teacher=[state] * (window + 1)), "reference run")
            if ref.error is not None:
                raise UserCodeError("the script run with --reference-args did not reach "
                                    f"window {window}: {ref.error.get('text')}",
                                    location=where(ref.error))
            if len(ref.ref_grads) <= window:
                reached = len(ref.ref_grads)
                raise UsageError(
                    f"the script run with the reference's arguments ended after {reached} "
                    f"optimizer step(s), before window {window} of the run: its data hold "
                    "fewer full batches than the run's windows (a last, partial window the "
                    "reference's batch size drops). Compare the windows both have: "
                    f"--steps {reached}" if reached else
                    "the script run with the reference's arguments made no optimizer step")
            grads = ref.ref_grads[window]
            if rng_seed is None:
                self._refs[(id(state), window)] = grads
                self._pinned.append(state)
        return window_reference(self, window, state, grads, per_mb, rng_seed is not None)

    def reference_for(self, *args: Any, **kwargs: Any) -> WindowReference:
        raise NotImplementedError("script mode cannot re-split a window")

    def adopt_weighting(self, weighting: str) -> None:
        self.notes.add(f"the script weighs micro-batches by {weighting}")

    # --- windows (as Session) -------------------------------------------------------------
    @property
    def micro_batches(self) -> list[Any]:
        """Stands for the micro-batches of the N windows (the script holds the data)."""
        return [None] * (self.N * self.K)

    def window(self, index: int) -> list[Any]:
        return []

    def window_of(self, step: Any, ordinal: int = 0, trace: Trace | None = None) -> int:
        window = (max(step.microbatch, 0) // self.K if trace is None
                  else trace.window_of_event(step))
        if window is None:
            window = ordinal
        return max(0, min(window, self.N - 1))

    def rung_done(self, rung_id: str) -> None:
        pass

    def random_modules(self) -> list[str]:
        fp32 = self.traces.get("fp32")
        return list(fp32.outcome.dropout) if fp32 is not None else []


def _per_window(injector: Any) -> int:
    """The backwards per window an injector was built for (`OverflowInjector`)."""
    window = max(injector.window, 0)
    return max(1, (injector.last_backward // (window + 1)) if injector.last_backward else 1)


def _same_first_input(a: Outcome, b: Outcome) -> bool:
    return bool(a.forwards and b.forwards and a.forwards[0].digests == b.forwards[0].digests)
