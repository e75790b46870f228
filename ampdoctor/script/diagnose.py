"""One script-mode diagnose end to end: the runs (`session`), the rungs (`rungs`), the record.

The record is spec mode's (CONTRACT §5) with `"script"`, `"args"`, `"reference_args"` and
`"reference_args_origin"` in place of a spec (`runner.new_record`), and `"found"`: what the
runs showed of the script (its models, optimizers, scaler, autocast, K and micro-batch), said
in one line too (`found_text`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core import processes
from ..core.enums import RungId
from ..core.errors import AmpdoctorError, UsageError, UserCodeError
from ..core.findings import RungResult
from ..spec.source import ScriptSource
from . import spawn
from .ahead import ENV as PARALLEL_ENV
from .command import Command
from .refused import PrecisionsRefused
from .session import ScriptSession

if TYPE_CHECKING:
    from ..record.model import RecordModel


def _count(n: int) -> str:
    return f"{n:,}"


def found(ss: ScriptSession) -> dict[str, Any]:
    """What the fp32 run showed of the script, as data and as one line."""
    out = ss.trace("fp32").outcome
    models = [{"type": m["type"], "parameters": m["params"],
               "file": m["site"].file if m["site"] else None,
               "line": m["site"].line if m["site"] else None} for m in out.models]
    optimizers = [o["type"] for o in out.optimizers]
    scalers = out.scalers
    autocasts = out.autocasts
    dtypes = sorted({a["dtype"] or "default" for a in autocasts})
    b = ss.spec.micro_batch_size
    parts = []
    if models:
        named = ", ".join(f"{m['type']}, {_count(m['parameters'])} params" for m in models)
        parts.append(f"{len(models)} model{'s' if len(models) > 1 else ''} ({named})")
    else:
        parts.append("no model (no optimizer holds a module's parameters)")
    parts.append(", ".join(optimizers) if optimizers else "no optimizer")
    if scalers:
        parts.append("GradScaler" + ("" if any(s["enabled"] for s in scalers)
                                     else " (disabled by the script's args)"))
    else:
        parts.append("no GradScaler")
    if autocasts:
        off = not any(a["enabled"] for a in autocasts)
        parts.append(f"autocast {'/'.join(_short(d) for d in dtypes)}"
                     + (" (disabled by the script's args)" if off else ""))
    else:
        parts.append("no autocast")
    parts.append(f"K = {ss.K}")
    if b is not None:
        parts.append(f"micro-batch {b}")
    if ss.reference_rows:
        parts.append(f"reference batch {ss.reference_rows}")
    return {"models": models, "optimizers": optimizers,
            "scaler": bool(scalers), "autocast": dtypes if autocasts else None,
            "accumulation_steps": ss.K, "micro_batch_size": b,
            "reference_batch": ss.reference_rows or None,
            "text": "found: " + ", ".join(parts)}


def _short(dtype: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def run_script(source: ScriptSource, on_start: Callable[[str], None] | None = None,
               on_done: Callable[[RungResult], None] | None = None,
               on_progress: Callable[[dict[str, Any]], None] | None = None,
               ) -> tuple[RecordModel, AmpdoctorError | None]:
    """Diagnose the script of `source` on the one ladder (`ladder.run_ladder`, with script
    mode's rungs); the run record, and the AmpdoctorError that stopped it before the ladder
    (the script could not run at all, a bad reference, a run past its time bound), which the
    record's `error` holds too."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ampdoctor-output-",
                                     dir=processes.temp_root()) as output_dir:
        command = Command(source.script, list(source.args),
                          list(source.reference_args) if source.reference_args is not None
                          else None, steps=source.optimizer_steps, timeout_s=source.timeout_s,
                          cwd=source.cwd, env=_environment(source.device),
                          output_dir=output_dir if source.capture_output else None,
                          defer_batch=source.reference_batch_option,
                          reference_rewrites=source.reference_rewrites)
        try:
            return _diagnose(source, command, started, on_start, on_done, on_progress)
        finally:
            spawn.stop_all()     # the last runs' processes (and any started ahead), before
            #                      their folders go


def _diagnose(source: ScriptSource, command: Command, started: float,
              on_start: Callable[[str], None] | None,
              on_done: Callable[[RungResult], None] | None,
              on_progress: Callable[[dict[str, Any]], None] | None,
              ) -> tuple[RecordModel, AmpdoctorError | None]:
    from ..core import progress
    from ..ladder import run_ladder
    from ..record.model import RunSeriesModel
    from ..runner import fill_record, new_record
    from .rungs import RUNGS, ahead, weights

    record = new_record(source, "unknown")
    ss = ScriptSession(command)
    ss.spec.precisions = list(source.precisions)
    ss.spec.rungs = list(source.rungs) if source.rungs is not None else None
    ss.spec.keep_going = source.keep_going
    ss.plan = ahead

    def started_rung(rung_id: str) -> None:
        progress.rung(rung_id)
        if on_start is not None:
            on_start(rung_id)

    with progress.listening(on_progress):
        try:
            fp32 = ss.start()
            _check_started(ss, fp32)
            _check_device(source, ss)
            record.device = str(ss.device)
            record.cuda_available = ss.device.type == "cuda"
            record.accumulation_steps = ss.K
            record.micro_batch_size = ss.spec.micro_batch_size
            record.found = found(ss)
            results = run_ladder(ss, started_rung, on_done, rungs=RUNGS, weights=weights(ss))
        except PrecisionsRefused as exc:
            refused = _refused_results(ss, exc, on_done)
            if refused is None:
                return _failed(source, record, ss, exc, started), exc
            results = refused
        except AmpdoctorError as exc:
            return _failed(source, record, ss, exc, started), exc
    fill_record(record, results)
    if ss.command.reference_args is not None:     # a reference inferred after a first step
        record.reference_args = list(ss.command.reference_args)
    record.notes = sorted(_notes(ss, source))
    record.runs = [RunSeriesModel.model_validate(run) for run in ss.charts]
    record.seconds = round(time.perf_counter() - started, 3)
    record.reference_mode = "script"
    if ss.outputs:
        record.output = ss.outputs
    return record, None


def _failed(source: ScriptSource, record: RecordModel, ss: ScriptSession,
            exc: AmpdoctorError, started: float) -> RecordModel:
    from ..runner import error_record
    failed = error_record(source, exc)
    for key in ("device", "cuda_available", "accumulation_steps", "micro_batch_size", "found"):
        if record.given(key):
            setattr(failed, key, getattr(record, key))
    failed.seconds = round(time.perf_counter() - started, 3)
    if ss.outputs:
        failed.output = ss.outputs
    return failed


def _refused_results(ss: ScriptSession, exc: PrecisionsRefused,
                     on_done: Callable[[RungResult], None] | None) -> list[RungResult] | None:
    """A script whose Trainer transformers/accelerate refused over its DeepSpeed config's
    precision: the double-scaling rung's search of the script and its config files names the
    two settings (as `ampdoctor scan` does); every other rung had no run to judge. None where
    the search does not find them (the error then says what the refusal means)."""
    from ..core.enums import Status
    from ..ladder import RUNG_IDS
    from ..ladder.precision_rungs import run_double_scaling
    from ..rules.trainer_precision import refusal_finding
    ss.spec.config_files = ss.config_arguments()
    result = run_double_scaling(ss)
    if not any(f.evidence.get("config_key") == exc.refusal.config_key for f in result.findings):
        if exc.location is None:
            return None
        # the scan cannot read the Trainer's precision (HfArgumentParser's --bf16): the refusal
        # itself says it, at the line that raised, with the config key in the config arguments
        finding = refusal_finding(exc.refusal, RungId.DOUBLE_SCALING, exc.location[0],
                                  exc.location[1], ss.spec.config_files)
        result = RungResult(RungId.DOUBLE_SCALING, Status.FAIL, (
            "an HF Trainer and its DeepSpeed config disagree on the precision: "
            f"{finding.evidence['outcome']}, read from the refusal (the scan cannot read a "
            "precision decided at run time)"),
            findings=[finding], details=result.details)
    results = []
    for rung_id in RUNG_IDS:
        if rung_id == RungId.DOUBLE_SCALING:
            done = result
        else:
            done = RungResult(rung_id, Status.NOT_RUN, (
                "no run reached an optimizer step: the Trainer and the DeepSpeed config it "
                f"hands over disagree on the precision (`{exc.refusal.config_key}`, "
                "see double-scaling)"))
        results.append(done)
        if on_done is not None:
            on_done(done)
    return results


def _environment(device: str) -> dict[str, str]:
    """The script's environment: ours, with `--device cpu` hiding CUDA from it and
    `--device cuda:N` showing it that one GPU (as its cuda:0)."""
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    return env


def _check_device(source: ScriptSource, ss: ScriptSession) -> None:
    """`--device cuda` cannot move a script's model: a script that put it elsewhere is a usage
    error saying so (cpu and auto always hold: cpu hides CUDA from the script)."""
    if source.device.startswith("cuda") and ss.device.type != "cuda":
        raise UsageError(f"--device {source.device}: the script put its model on "
                         f"{ss.device.type}; script mode runs the script as it is and cannot "
                         "move it. Give the script the argument that selects the GPU, or leave "
                         "--device out")


def _notes(ss: ScriptSession, source: ScriptSource) -> set[str]:
    command = ss.command
    notes = set(ss.notes)
    if ss.unaligned is not None and command.reference_args is not None:
        notes.add(f"the reference does not read the run's micro-batches: {ss.unaligned}. The "
                  "rungs that compare updates were not run; make the data the same for every "
                  "batch size (seed it, no shuffling) to compare them")
    if source.reference_origin == "inferred" and source.reference_batch_option is None:
        notes.add("the reference's arguments were inferred from the script's options ("
                  f"{source.reference_how}); give --reference-args to set them yourself")
    if command.reference_args is None:
        notes.add("no reference: the updates were not compared with an fp32 full-batch "
                  "reference. Give --reference-args, the script's arguments for K = 1 and a "
                  f"batch K times the micro-batch (here K = {ss.K}, micro-batch "
                  f"{ss.spec.micro_batch_size})")
    if ss.runs.failed_beside:
        notes.add(f"the {' and the '.join(ss.runs.failed_beside)} failed beside another run of "
                  "the script and not alone: it was run again alone and the runs after it one "
                  "at a time (two copies of the script cannot run at once: a port, a lock or "
                  f"the memory it holds); {PARALLEL_ENV}=0 runs them one at a time from the "
                  "start")
    dropout = ss.random_modules()
    if dropout:
        notes.add("dropout was off in every run (" + ", ".join(dropout[:3]) + "): a reference "
                  "over the whole window cannot draw the micro-batches' masks")
    fp32 = ss.traces.get("fp32")
    compiled = sorted({os.path.basename(c) for c in fp32.outcome.compiled}) if fp32 else []
    if compiled:
        notes.add("torch.compile (" + ", ".join(compiled[:3]) + ") ran eager in every run: an "
                  "accumulation or precision mistake changes the updates the same way, and "
                  "each run would compile anew (minutes on a CPU)")
    grouped = sorted({os.path.basename(c) for c in fp32.outcome.group_of_one}) if fp32 else []
    if grouped:
        notes.add("torch.distributed.init_process_group (" + ", ".join(grouped[:3]) + ") found "
                  "no launcher's RANK/WORLD_SIZE: every run formed a process group of one "
                  "(RANK=0, WORLD_SIZE=1, a free MASTER_PORT), as `torchrun --nproc_per_node 1` "
                  "would; the ddp-sync rung needs two ranks (a spec with `ddp`)")
    draws = fp32.outcome.expected_draws if fp32 is not None else []
    if draws:
        notes.add("random draws in the model's forward took their expected values in every run "
                  "(" + ", ".join(draws[:3]) + "): a keep-mask is its probability (stochastic "
                  "depth passes its input through), a uniform draw its midpoint, a normal draw "
                  "its mean; a reference over the whole window would draw them in another "
                  "order than the micro-batches")
    return notes


def _check_started(ss: ScriptSession, fp32: Any) -> None:
    """The fp32 run must have reached an optimizer step of a model ampdoctor found."""
    out = fp32.outcome
    if out.error is not None and not fp32.steps:
        site = out.error.get("site")
        raise UserCodeError(
            f"the script {'exited' if out.ended.startswith('exit') else 'raised'} before its "
            f"first optimizer step: {out.error.get('text')}",
            location=(site.file, site.line) if site is not None else None)
    if not out.optimizers:
        raise UserCodeError(
            f"the script {_how_it_ended(out.ended)} without building a torch.optim optimizer: "
            "ampdoctor finds the model through the optimizer that holds its parameters")
    if not out.models:
        raise UserCodeError("no torch.nn.Module built by the script holds the parameters of its "
                            "optimizer: ampdoctor cannot tell which model it trains")
    if not fp32.steps:
        raise UserCodeError(
            f"the script ran {len(out.forwards)} forward(s) of its model and "
            f"{out.backward_count} backward(s) but never stepped its optimizer: it "
            f"{_how_it_ended(out.ended)}")


def _how_it_ended(ended: str) -> str:
    """`Outcome.ended` in words: "ran to its end", "called sys.exit(0)"."""
    if ended.startswith("exit "):
        return f"called sys.exit({ended.removeprefix('exit ')})"
    return {"finished": "ran to its end"}.get(ended, f"ended ({ended})")
