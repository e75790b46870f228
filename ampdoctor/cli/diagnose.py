"""`ampdoctor diagnose SPEC`: run the triage ladder, show the record, exit with its code.

The loop runs in a child process the command watches (`supervise.run`); under torchrun, rank 0
runs the ladder and the other ranks serve the ddp-sync rung. Torch is imported only once a
diagnose starts.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from ..core.errors import AmpdoctorInterrupt, LaunchError, SpecError, UsageError, UserCodeError
from ..core.processes import owned
from ..core.safetext import inert
from .ci_reports import CiOptions
from .common import INTERNAL_ERROR, fail, internal, stderr_console, stdout_console
from .completion import complete_rungs
from .progress_line import ProgressLine

if TYPE_CHECKING:
    from ..record.model import RecordModel, RungModel


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def diagnose(
    spec: Path = typer.Argument(..., help="The YAML spec of the run to triage, or a training "
                                "script (.py) to run as it is: script mode."),
    script_args: list[str] | None = typer.Argument(None, help="Script mode: the script's own "
                                                   "arguments, after `--`."),
    reference_args: str | None = typer.Option(None, "--reference-args", help="Script mode: the "
                                              "script's arguments for the fp32 full-batch "
                                              "reference (K = 1, batch K x b), quoted."),
    no_reference: bool = typer.Option(False, "--no-reference", help="Script mode: run no "
                                      "reference (none can be made of the script): only the "
                                      "checks that need none, so at best inconclusive."),
    json_out: bool = typer.Option(False, "--json", help="Print the run record as JSON on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks (the user's code's "
                               "full traceback too; the record keeps it either way)."),
    out: Path | None = typer.Option(None, "--out", help="Folder for run records "
                                    "(default .ampdoctor/runs)."),
    device: str | None = typer.Option(None, "--device", help="Override the spec's device: "
                                      "auto, cpu, cuda or cuda:N."),
    precisions: str | None = typer.Option(None, "--precisions", help="Override the spec's "
                                          "precisions, comma-separated (fp32 always runs), "
                                          "e.g. fp32,bf16."),
    rungs: str | None = typer.Option(None, "--rungs", help="Run only these rungs, "
                                     "comma-separated, e.g. fp32-accum,fp16-scaler; the "
                                     "others are reported as skipped.",
                                     autocompletion=complete_rungs),
    steps: int | None = typer.Option(None, "--steps", help="Override optimizer_steps (the "
                                     "slice must hold steps x K x b samples)."),
    keep_going: bool = typer.Option(False, "--keep-going", help="Run every rung even after "
                                    "one fails (each later rung marked 'after a failure'); "
                                    "the exit code and failed_rung stay the first failure's."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the training code's "
                                 "own output (prints, warnings) as every run goes; otherwise "
                                 "it is kept in the record and a failing run's first output "
                                 "is shown."),
    strict: bool = typer.Option(False, "--strict", help="Warnings fail the run too (exit 1), "
                                "for CI."),
    junit: Path | None = typer.Option(None, "--junit", metavar="FILE", help="Also write a "
                                      "JUnit XML report to FILE (one test case per rung)."),
    sarif: Path | None = typer.Option(None, "--sarif", metavar="FILE", help="Also write a "
                                      "SARIF 2.1.0 report to FILE (one result per finding, at "
                                      "your file:line)."),
) -> None:
    """Run the triage ladder on SPEC and report what is wrong, with numbers and file:line."""
    overrides = {"device": device, "precisions": _csv(precisions), "rungs": _csv(rungs),
                 "optimizer_steps": steps, "keep_going": True if keep_going else None}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    ci = CiOptions(strict, junit, sarif)
    if spec.suffix == ".py":   # script mode: the same driver, another source of runs
        from .script_mode import script_source_of
        try:
            source = script_source_of(spec, script_args or [], reference_args, no_reference,
                                      dict(overrides, capture_output=not verbose))
        except UsageError as exc:
            raise typer.Exit(fail(exc, debug)) from None
        if source.reference_origin == "inferred" and source.reference_args is not None:
            shown = shlex.join(source.reference_args) or "your arguments"
            if source.reference_rewrites:
                shown += " with " + " ".join(f"{name}={value}" for _, name, _, _, value
                                             in source.reference_rewrites) + " in the script"
            stderr_console().print(f"reference: {shown} (inferred: "
                                   f"{source.reference_how})", markup=False, highlight=False,
                                   soft_wrap=True)
        elif source.reference_batch_option is not None:
            stderr_console().print(f"reference: {source.reference_batch_option} K x the "
                                   "micro-batch, K read from a first fp32 step (inferred: "
                                   f"{source.reference_how})", markup=False, highlight=False,
                                   soft_wrap=True)
        try:
            code = diagnose_here(source, json_out, debug, out, ci=ci, verbose=verbose)
        finally:
            if source.reference_origin == "inferred":
                from ..script.infer_config import remove_copies
                remove_copies()
        raise typer.Exit(code)
    if script_args or reference_args is not None or no_reference:
        raise typer.Exit(fail(UsageError("arguments after the spec, --reference-args and "
                                         "--no-reference are for script mode (`ampdoctor "
                                         "diagnose train.py -- ARGS`); a spec takes none: its "
                                         "reference is built from its loop"), debug))
    raise typer.Exit(run_diagnose(spec, json_out, debug, out, overrides, ci=ci,
                                  verbose=verbose))




def run_diagnose(spec_path: Path, json_out: bool, debug: bool, out: Path | None,
                 overrides: dict[str, Any] | None = None, ci: CiOptions | None = None,
                 verbose: bool = False) -> int:
    """Load the spec (with the command line's overrides) and diagnose it; the exit code."""
    from ..api import load
    from ..spec.source import FLAGS  # the flag of each override: messages name it, not the line
    try:
        spec = load(spec_path, origins={k: FLAGS[k] for k in overrides or {} if k in FLAGS},
                    **(overrides or {}))
    except SpecError as exc:
        return fail(exc, debug)

    from ..ddp import launch

    launched = launch.launched_rank()
    if launched is None:
        return diagnose_here(spec, json_out, debug, out, ci=ci, verbose=verbose)
    # torchrun supervises its own processes; the ranks share a store with this one
    # Under torchrun: rank 0 runs the ladder and reports; the others serve the ddp-sync rung.
    try:
        group = launch.TorchrunGroup(*launched, connect_timeout_s=(
            spec.ddp.timeout_s if spec.ddp is not None else launch.DEFAULT_TIMEOUT_S))
    except LaunchError as exc:
        return fail(exc, debug)
    if launched[0] != 0:
        return group.serve(spec)
    launch.GROUP = group
    code = INTERNAL_ERROR
    try:
        code = diagnose_here(spec, json_out, debug, out, isolate=False, ci=ci,
                             verbose=verbose)
    finally:
        launch.GROUP = None
        group.finish(code)
    return code


def _isolated() -> bool:
    """Run the loop in a child process (the default). `AMPDOCTOR_IN_PROCESS=1` runs it in this
    process instead: for a debugger (`breakpoint()` in the loop needs the terminal), with no
    watchdog beyond the loop's own SIGALRM stop."""
    return os.environ.get("AMPDOCTOR_IN_PROCESS", "").strip().lower() not in ("1", "true", "yes")


def writable_out(out: Path | None) -> Path:
    """The records folder as an absolute path (a loop that changes the working directory
    cannot move it), checked before any rung runs: UsageError when it cannot be written."""
    from .. import record as records
    folder = Path(os.path.abspath(out if out is not None else records.DEFAULT_DIR))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        import tempfile
        fd, probe = tempfile.mkstemp(dir=folder, prefix=records.TMP_PREFIX, suffix=".check")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"--out {out or records.DEFAULT_DIR}: the records folder cannot be "
                         f"written ({reason}): give a folder you can write to.",
                         cause=exc) from exc
    return folder


def diagnose_here(spec: Any, json_out: bool, debug: bool, out: Path | None,
                  isolate: bool = True, ci: CiOptions | None = None,
                  verbose: bool = False) -> int:
    """Diagnose `spec` (a Spec or a `source.ScriptSource`) from this process (the runs in a
    child unless `isolate` is False or AMPDOCTOR_IN_PROCESS is set), save and show the record
    (and the CI reports `ci` asks for); the exit code. The training code's own output is
    kept in the record (`output`) unless `verbose`, which shows it as it comes."""
    from ..report.terminal import render
    from ..runner import error_record
    from ..supervise import ChildCrashed

    err = stderr_console()
    ci = ci or CiOptions()
    try:
        folder = writable_out(out)
        ci.check()
    except UsageError as exc:
        return fail(exc, debug)
    done: list[RungModel] = []      # the rungs that finished
    started: list[str] = []      # the rungs begun: the last one is where a signal stops it
    captured = None if verbose else Captured()
    try:
        with ProgressLine(err, quiet=json_out) as progress, _signals_interrupt():
            if isolate and _isolated():
                record, exception = _run_isolated(spec, progress, done, err, started, captured)
            else:
                # (what the loop starts ends with it: `processes.owned`)
                with contextlib.redirect_stdout(sys.stderr), owned():
                    record, exception = _run_in_process(spec, progress, done, started)
    except (KeyboardInterrupt, Interrupted) as exc:
        # Like a finished run: the terminal restored (the status spinner has exited), the
        # run stopped (its process killed, or torch restored in this one), and a record
        # saying where it stopped.
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        name = signal.Signals(signum).name
        where = (f" during the {started[-1]} rung" if len(started) > len(done)
                 else " while loading the spec's code" if not started else "")
        error = UserCodeError(f"interrupted by {name}{where} after {len(done)} rung(s); the "
                              "record holds the rungs that finished", cause=exc)
        interrupted = error_record(spec, error)
        interrupted.rungs = done
        err.print(f"ampdoctor: interrupted by {name}; the run was stopped.", markup=False)
        ci.write(interrupted, err, 128 + int(signum))
        save_and_show(interrupted, folder, json_out, render, err, 128 + int(signum))
        return 128 + int(signum)
    except (SpecError, LaunchError) as exc:
        return fail(exc, debug)
    except ChildCrashed as exc:     # a bug in ampdoctor, in the process that ran the loop
        if debug and exc.remote_traceback:
            sys.stderr.write(inert(exc.remote_traceback))
        return internal(exc, False)
    except Exception as exc:  # noqa: BLE001 - a bug in ampdoctor itself
        return internal(exc, debug)
    if record is None:            # stopped by an error before there was anything to record
        assert exception is not None
        return fail(exception, debug)
    from .. import record as records
    if captured is not None and captured.text and not record.given("output"):
        record.output = [{"run": "the loop's runs", "text": captured.text}]
    show_output(record, err, every=debug)
    ci.mark(record)
    code = records.exit_code(record)
    if exception is not None:
        code = fail(exception, debug)
    elif debug:
        _show_tracebacks(record, err)
    if not ci.write(record, err, code):
        code = UsageError.exit_code
    if not save_and_show(record, folder, json_out, render, err, code):
        return UsageError.exit_code
    return code


def _show_tracebacks(record: RecordModel, err: Console) -> None:
    """--debug: the traceback each finding kept (the user's code raising in a rung)."""
    for finding in record.findings:
        if finding.traceback:
            err.print(inert(f"traceback of the {finding.kind} in rung {finding.rung}:"),
                      markup=False, highlight=False)
            sys.stderr.write(inert(finding.traceback))


def _run_in_process(spec: Any, progress: ProgressLine, done: list[RungModel],
                    started: list[str]) -> tuple[RecordModel | None, Any]:
    """The diagnose in this process (AMPDOCTOR_IN_PROCESS, or a torchrun rank 0)."""
    from ..record.model import RungModel
    from ..spec.source import ScriptSource

    def on_done(result: Any) -> None:
        done.append(RungModel.of(result))

    if isinstance(spec, ScriptSource):
        from ..script.diagnose import run_script
        return run_script(spec, on_start=started.append, on_done=on_done,
                          on_progress=progress)
    from ..api import diagnose as run
    result = run(spec, save=False, on_start=started.append, on_done=on_done,
                 on_progress=progress)
    return result, result.exception


class Captured:
    """The training code's output, kept (its first and last OUTPUT_KEPT bytes) instead of
    shown."""

    def __init__(self) -> None:
        self.head = ""
        self.tail = ""
        self.cut = 0

    def __call__(self, text: str) -> None:
        room = OUTPUT_KEPT - len(self.head)
        if room > 0:
            self.head += text[:room]
            text = text[room:]
        self.tail += text
        if len(self.tail) > OUTPUT_KEPT:
            self.cut += len(self.tail) - OUTPUT_KEPT
            self.tail = self.tail[-OUTPUT_KEPT:]

    @property
    def text(self) -> str:
        middle = f"\n[... {self.cut} characters cut ...]\n" if self.cut else ""
        return self.head + middle + self.tail


#: the most of the training code's output a record keeps, from its start and from its end
OUTPUT_KEPT = 16 * 1024


def show_output(record: RecordModel, err: Console, every: bool) -> None:
    """The captured output of the training code on stderr: every run's with `every` (--debug),
    else the first run's once when the run ended in an error (what a crash printed)."""
    outputs = [o for o in record.output or [] if o.get("text")]
    if not outputs or not (every or record.verdict == "error"):
        return
    for entry in outputs if every else outputs[:1]:
        err.print(inert(f"--- output of the {entry.get('run')} (captured; --verbose shows it "
                        "as it runs) ---"), markup=False, highlight=False, style="dim")
        sys.stderr.write(inert(str(entry["text"])))
        if not str(entry["text"]).endswith("\n"):
            sys.stderr.write("\n")
        sys.stderr.flush()


def _run_isolated(spec: Any, progress: ProgressLine, done: list[RungModel],
                  err: Console, started: list[str], captured: Captured | None = None,
                  ) -> tuple[RecordModel | None, Any]:
    """The diagnose in a child process (`supervise.run`): its events drive the progress line,
    its output goes to stderr (or to `captured`)."""
    from .. import supervise

    def on_event(event: dict[str, Any]) -> None:
        kind = event.pop("event", None)
        if kind == "progress":
            progress(event)
        elif kind == "done" and event.get("rung"):
            # (pydantic's models are imported once the worker runs: here, not before it starts)
            from ..record.model import RungModel
            done.append(RungModel.model_validate(event["rung"]))
        elif kind == "rung":
            started.append(str(event.get("id")))

    def on_output(text: str) -> None:
        if captured is not None:
            captured(text)
        elif progress.status is not None:
            err.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        else:
            sys.stderr.write(text)
            sys.stderr.flush()

    outcome = supervise.run(spec, wire(spec), on_event, on_output)
    return outcome.record, outcome.error


def wire(spec: Any) -> str:
    """The run source as the worker rebuilds it: a spec's keys, or a script's command."""
    from ..spec.source import ScriptSource
    if isinstance(spec, ScriptSource):
        from ..spec.source import to_wire as script_wire
        return script_wire(spec)
    from ..spec import to_wire
    return str(to_wire(spec))


class Interrupted(AmpdoctorInterrupt):
    """SIGTERM or SIGHUP during a diagnose: handled like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Interrupted in the main thread while a diagnose runs."""
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous: dict[int, Any] = {}
    for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)):
        if sig is not None:
            # ValueError: not the main thread
            with contextlib.suppress(ValueError):
                previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def save_and_show(record: RecordModel, out: Path, json_out: bool,
                  render: Callable[[RecordModel, Console], None], err: Console,
                  code: int) -> bool:
    """Save the record (its `exit_code` the process's), then show it; False (and a clear
    line) when it could not be saved (exit 2, which the record shown says)."""
    from .. import record as records
    record.exit_code = code
    try:
        path = records.save(record, out)
        saved = True
    except OSError as exc:
        record.exit_code = UsageError.exit_code
        saved = False
        problem = (f"ampdoctor: usage error: could not save the record under "
                   f"{out or records.DEFAULT_DIR}: {exc}")
    if json_out:
        sys.stdout.write(records.dumps(record))
    else:
        render(record, stdout_console())
    if saved:
        err.print(inert(f"record saved to {path}"), highlight=False, markup=False,
                  style="dim", soft_wrap=True)
    else:
        err.print(inert(problem), highlight=False, markup=False, style="bold red")
    return saved

