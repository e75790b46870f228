"""The run of a diagnose, under `ampdoctor.diagnose()` and the CLI: install the probe, import
the user's code, run the ladder, and build the run record. Torch is restored and the user's
modules forgotten on every exit path."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from .._version import __version__
from ..core.enums import KindId
from ..core.errors import (
    AmpdoctorError,
    InputError,
    UsageError,
    UserCodeError,
    format_traceback,
)
from ..core.findings import RungResult
from ..spec import Spec
from ..spec.source import ScriptSource

if TYPE_CHECKING:
    from pathlib import Path

    from ..loading import UserCode
    from ..record.model import RecordModel


@contextlib.contextmanager
def _deterministic_cuda() -> Iterator[None]:
    """TF32 would put ~1e-3 noise into fp32 matmuls on Ampere+: off while we compare."""
    import torch
    if not torch.cuda.is_available():
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@contextlib.contextmanager
def _no_hard_exit() -> Iterator[None]:
    """`os._exit()` from the user's code in this process becomes a SystemExit ampdoctor records
    (a loop error, exit 3): it would otherwise end the process with no record -- `os._exit(0)`
    as a silent "healthy". Forked children (DataLoader workers) exit as they always do."""
    import os

    real = os._exit
    pid = os.getpid()

    def _exit(status: int) -> NoReturn:
        if os.getpid() != pid:
            real(status)
        raise SystemExit(f"os._exit({status})")

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


def run_diagnose(spec: Spec, on_start: Callable[[str], None] | None = None,
                 on_done: Callable[[RungResult], None] | None = None,
                 on_progress: Callable[[dict[str, Any]], None] | None = None) -> RecordModel:
    """Run the ladder on a validated spec and return the run record.

    `on_progress` is called at each optimizer step of the loop's runs with
    {"rung", "precision", "step", "steps"}. The process is left as it was found
    (`process_state`), whatever the loop did; a second diagnose started in another thread while
    one runs raises UsageError at once."""
    if not _ONE_AT_A_TIME.acquire(blocking=False):
        raise UsageError("another ampdoctor diagnose is running in this process: ampdoctor "
                         "patches torch process-wide while it runs, so one diagnose runs at a "
                         "time. Wait for the other to return, or run this one in its own "
                         "process (the `ampdoctor diagnose` command does).")
    try:
        return _run_diagnose(spec, on_start, on_done, on_progress)
    finally:
        _ONE_AT_A_TIME.release()


#: One diagnose at a time in a process (the probe patches torch for everyone).
_ONE_AT_A_TIME = threading.Lock()


def _run_diagnose(spec: Spec, on_start: Callable[[str], None] | None,
                  on_done: Callable[[RungResult], None] | None,
                  on_progress: Callable[[dict[str, Any]], None] | None) -> RecordModel:
    import torch

    from ..core import progress
    from ..core.process_state import ProcessState
    from ..ladder import run_ladder
    from ..loading import UserCode, check_finite, cut_micro_batches, resolve_device
    from ..probe import patches, recorder, wrappers
    from ..probe.callsite import CallSiteFinder
    from ..record.model import RunSeriesModel
    from ..session import Session

    before = ProcessState.take()
    started = time.perf_counter()
    device = resolve_device(spec.device, spec)
    finder = CallSiteFinder([spec.root, spec.spec_dir])
    record = new_record(spec, str(device))
    rng_state = torch.get_rng_state()
    code = None
    def started_rung(rung_id: str) -> None:
        progress.rung(rung_id)
        if on_start is not None:
            on_start(rung_id)

    with patches.installed(wrappers.install), _deterministic_cuda(), _no_hard_exit(), \
            progress.listening(on_progress):
        try:
            code = UserCode(spec, finder)
            data = code.call("the data factory", code.data_factory)
            micro_batches = cut_micro_batches(data, spec)
            check_finite(micro_batches)
            session = Session(spec, code, device, finder, micro_batches)
            results = run_ladder(session, started_rung, on_done)
            record.notes = sorted(session.notes | _left_behind_notes(code))
            record.runs = [RunSeriesModel.model_validate(run) for run in session.charts]
        finally:
            recorder.activate(None)
            if code is not None:
                code.forget()
            torch.set_rng_state(rng_state)
            before.restore()
    fill_record(record, results)
    record.seconds = round(time.perf_counter() - started, 3)
    record.reference_mode = "loss" if spec.loss else "loop"
    return record


def _left_behind_notes(code: UserCode) -> set[str]:
    from ..core.process_state import DESCRIBED
    return {f"your loop left {DESCRIBED.get(name, name)} changed when it returned; ampdoctor "
            "restored it after each run, so no later run or reference inherited it"
            for name in code.left_behind}


def environment(spec: Spec | None) -> dict[str, Any]:
    """Where and with what a record was made: for a postmortem read weeks later."""
    import datetime
    import platform
    import socket
    import sys

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "python": platform.python_version(),
        "platform": platform.platform(terse=True)}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        try:
            env["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
            env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        except Exception:  # noqa: BLE001 - a driver problem must not cost the record
            env["gpu"] = None
    if spec is not None:
        env["git_commit"] = _git_commit(spec.root)
        if spec.spec_path is not None:
            try:
                env["spec_text"] = spec.spec_path.read_text(encoding="utf-8")[:MAX_SPEC_TEXT]
            except (OSError, UnicodeDecodeError):
                env["spec_text"] = None
        else:   # built in code: its keys, callables by their module:function
            import yaml
            env["spec_text"] = yaml.safe_dump(
                spec.model_dump(mode="json", exclude_unset=True), sort_keys=False)[:MAX_SPEC_TEXT]
    return env


#: The spec's text kept in a record (a spec is small; this bounds a strange one).
MAX_SPEC_TEXT = 64 * 1024


def _git_commit(root: Path) -> str | None:
    """The commit of the user's project when it is a git tree (read-only: no index refresh),
    with `+dirty` when it has uncommitted changes; None otherwise."""
    import os
    import subprocess

    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5, env=env)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=5, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def new_record(spec: Spec | ScriptSource, device: str) -> RecordModel:
    """The record before any rung ran, for a spec or a script (`source.ScriptSource`): a
    script's names the script, its args and the reference's args (and whether they were
    given or inferred) where a spec's names the spec file."""
    if isinstance(spec, ScriptSource):
        return blank_record(
            spec=None,
            source={"script": spec.script, "args": list(spec.args),
                    "reference_args": (list(spec.reference_args)
                                       if spec.reference_args is not None else None),
                    "reference_args_origin": spec.reference_origin,
                    "reference_args_inferred": (None if spec.reference_origin is None
                                                else spec.reference_origin == "inferred"),
                    "reference_literals": (
                        [{"name": name, "line": line, "value": value}
                         for _, name, line, _, value in spec.reference_rewrites]
                        if spec.reference_rewrites else None),
                    "cwd": spec.cwd},
            name=spec.display_name, device=device, accumulation_steps=None,
            optimizer_steps=spec.optimizer_steps, micro_batch_size=None,
            environment=environment(None))
    return blank_record(spec=str(spec.spec_path) if spec.spec_path else None, source={},
                        name=spec.display_name, device=device,
                        accumulation_steps=spec.accumulation_steps,
                        optimizer_steps=spec.optimizer_steps,
                        micro_batch_size=spec.micro_batch_size, environment=environment(spec))


def blank_record(*, spec: str | None, source: dict[str, Any], name: str, device: str,
                 accumulation_steps: int | None, optimizer_steps: int,
                 micro_batch_size: int | None, environment: dict[str, Any]) -> RecordModel:
    """The record before any rung ran (verdict "error" until it is filled), for a spec or,
    with `source` (script, args, reference_args) after `spec`, a script."""
    from ..record.model import RecordModel, SeriesModel
    return RecordModel(
        record_version=1,
        ampdoctor_version=__version__,
        spec=spec,
        **source,
        name=name,
        device=device,
        cuda_available=device.startswith("cuda"),
        accumulation_steps=accumulation_steps,
        optimizer_steps=optimizer_steps,
        micro_batch_size=micro_batch_size,
        verdict="error",
        failed_rung=None,
        rungs=[],
        findings=[],
        series=SeriesModel(scale=[], grad_norm_before_unscale=[], grad_norm_after_unscale=[],
                           skipped=[]),
        error=None,
        environment=environment,
    )


def fill_record(record: RecordModel, results: list[RungResult]) -> None:
    """The rungs and findings into the record, and the verdict. Under keep_going the rungs
    after the first failure are in it, each marked `after_failure` (and their findings too);
    the verdict, `failed_rung` and so the exit code are the first failure's alone."""
    from ..record.model import FindingModel, RungModel, attach_source
    record.rungs = []
    record.findings = []
    series: list[dict[str, Any]] = []
    for r in results:
        # what the rung handed the record, not the rung's own details
        later = bool(r.details.pop("after_failure", False))
        part = r.details.pop("series", None)
        if part:
            series.append(part)
        rung = RungModel.of(r)
        if later:
            rung.after_failure = True
        record.rungs.append(rung)
        for f in r.findings:
            finding = FindingModel.of(f, after_failure=later)
            attach_source(finding)
            record.findings.append(finding)
    failed = next((r for r in results if r.status == "fail"), None)
    record.failed_rung = failed.id.value if failed else None
    if any(r.after_failure for r in record.rungs):
        record.keep_going = True
    # the verdict is the first failure's: what ran after it does not change it
    decided = results[:results.index(failed) + 1] if failed else results
    loop_errors = [f for r in decided for f in r.findings if f.kind == KindId.LOOP_ERROR]
    if loop_errors:
        record.verdict = "error"
    elif failed:
        record.verdict = "failed"
    elif not any(compared(r) for r in results):
        # nothing wrong was seen, but nothing was compared either: not a clean bill
        record.verdict = "inconclusive"
        record.inconclusive = inconclusive_reason(results)
    else:
        record.verdict = "healthy"
    for part in series:
        for key, values in part.items():
            setattr(record.series, key, values)


def compared(result: RungResult) -> bool:
    """Whether a rung compared at least one consumed update with its fp32 reference (the
    rungs that do say how many in `steps_compared`)."""
    return result.status in ("pass", "warn", "fail") and \
        int(result.details.get("steps_compared") or 0) > 0


def inconclusive_reason(results: list[RungResult]) -> str:
    """Why a run with no failure is not healthy: no rung compared an update, and why each
    comparing rung did not (its skip reason)."""
    why = [f"{r.id}: {r.summary}" for r in results
           if r.id in COMPARING_RUNGS and r.status in ("skip", "not-run") and r.summary]
    return ("no rung compared an update with the fp32 reference, so nothing says the "
            "training matches it" + (" (" + "; ".join(why) + ")" if why else ""))


#: The rungs that compare consumed updates with the fp32 reference.
COMPARING_RUNGS = ("fp32-accum", "bf16-no-scaler", "fp16-scaler", "clip-space", "ddp-sync")


def error_record(spec: Spec | ScriptSource | None, exc: AmpdoctorError,
                 device: str = "unknown") -> RecordModel:
    """A record for a run that could not start (bad spec is not recorded; user code is)."""
    from ..record.model import ErrorModel, LocationModel, RecordModel, attach_source
    if device == "unknown" and spec is not None:
        device = spec.device
    record = new_record(spec, device) if spec is not None else RecordModel(
        record_version=1, ampdoctor_version=__version__, verdict="error")
    record.verdict = "error"
    error = record.error = ErrorModel(type=type(exc).__name__, message=exc.message,
                                      exit_code=exc.exit_code)
    location = getattr(exc, "location", None)
    if location:
        error.location = LocationModel(file=location[0], line=location[1])
        attach_source(error)
    if isinstance(exc, (UserCodeError, InputError)) and exc.cause is not None:
        error.traceback = format_traceback(exc.cause)
    return record
