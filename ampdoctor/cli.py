"""The command line: parse, call one function per command, map errors to exit codes.

Exit codes (CONTRACT §5): 0 healthy, 1 a rung failed, 2 bad spec or usage, 3 the user's code
could not run. Torch is imported only inside `diagnose`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from . import __version__
from .safetext import FIELD_LIMIT, MESSAGE_LIMIT, TRACEBACK_LIMIT, exc_text, inert
from .errors import (AmpdoctorError, AmpdoctorInterrupt, LaunchError, SpecError, UsageError,
                     UserCodeError, format_traceback)

app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  help="Triage PyTorch training that combines gradient accumulation with mixed "
                       "precision (fp16 + GradScaler, or bf16).",
                  epilog="Exit codes (diagnose): 0 healthy (warnings allowed), 1 a rung failed, "
                         "2 bad spec or usage, 3 your model, data or loop could not run (or "
                         "hung, or exited), 4 an internal ampdoctor error; 128 + N after "
                         "signal N (Ctrl-C 130, SIGTERM 143). scan: 0 nothing found, 1 more "
                         "than one loss-scale owner, 2 a bad path. report: 0 rendered, 2 a "
                         "missing or invalid record.")

INTERNAL_ERROR = 4


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ampdoctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_callback(version: bool = typer.Option(False, "--version", callback=_version,
                                               is_eager=True, help="Print the version and exit.")):
    """ampdoctor: find the line that breaks accumulation + AMP."""


def _stderr() -> Console:
    return Console(stderr=True)


def _fail(exc: AmpdoctorError, debug: bool) -> int:
    err = _stderr()
    if debug and exc.cause is not None:
        sys.stderr.write(inert(format_traceback(exc.cause) or "", limit=TRACEBACK_LIMIT))
    elif debug and getattr(exc, "remote_traceback", None):   # raised in the run's process
        sys.stderr.write(inert(exc.remote_traceback))
    label = ("DDP launch error" if isinstance(exc, LaunchError) else
             {2: "spec error" if isinstance(exc, SpecError) else "usage error",
              3: "user code error"}.get(exc.exit_code, "error"))
    err.print(f"[bold red]ampdoctor: {label}:[/] ", end="", highlight=False)
    # (a spec error lists up to 20 problems; a user exception quoted in it is already cut)
    err.print(inert(exc.message, limit=4 * MESSAGE_LIMIT), markup=False, highlight=False)
    return exc.exit_code


def _internal(exc: BaseException, debug: bool) -> int:
    if debug:
        sys.stderr.write(inert(format_traceback(exc) or "", limit=TRACEBACK_LIMIT))
    err = _stderr()
    err.print("[bold red]ampdoctor: internal error:[/] ", end="", highlight=False)
    err.print(f"{inert(exc_text(exc))} (run again with --debug for the traceback)",
              markup=False, highlight=False)
    return INTERNAL_ERROR


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


@app.command()
def diagnose(
    spec: Path = typer.Argument(..., help="The YAML spec of the run to triage."),
    json_out: bool = typer.Option(False, "--json", help="Print the run record as JSON on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks (the user's code's "
                               "full traceback too; the record keeps it either way)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for run records "
                                       "(default .ampdoctor/runs)."),
    device: Optional[str] = typer.Option(None, "--device", help="Override the spec's device: "
                                         "auto, cpu, cuda or cuda:N."),
    precisions: Optional[str] = typer.Option(None, "--precisions", help="Override the spec's "
                                             "precisions, comma-separated (fp32 always runs), "
                                             "e.g. fp32,bf16."),
    rungs: Optional[str] = typer.Option(None, "--rungs", help="Run only these rungs, "
                                        "comma-separated, e.g. fp32-accum,fp16-scaler; the "
                                        "others are reported as skipped."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Override optimizer_steps (the "
                                        "slice must hold steps x K x b samples)."),
) -> None:
    """Run the triage ladder on SPEC and report what is wrong, with numbers and file:line."""
    overrides = {"device": device, "precisions": _csv(precisions), "rungs": _csv(rungs),
                 "optimizer_steps": steps}
    raise typer.Exit(_diagnose(spec, json_out, debug, out,
                               {k: v for k, v in overrides.items() if v is not None}))


def _diagnose(spec_path: Path, json_out: bool, debug: bool, out: Path | None,
              overrides: dict | None = None) -> int:
    from .api import load
    try:
        spec = load(spec_path, **(overrides or {}))
    except SpecError as exc:
        return _fail(exc, debug)

    from .ddp import launch

    launched = launch.launched_rank()
    if launched is None:
        return _diagnose_here(spec, json_out, debug, out)
    # torchrun supervises its own processes; the ranks share a store with this one
    # Under torchrun: rank 0 runs the ladder and reports; the others serve the ddp-sync rung.
    try:
        group = launch.TorchrunGroup(*launched, connect_timeout_s=(
            spec.ddp.timeout_s if spec.ddp is not None else launch.DEFAULT_TIMEOUT_S))
    except LaunchError as exc:
        return _fail(exc, debug)
    if launched[0] != 0:
        return group.serve(spec)
    launch.GROUP = group
    code = INTERNAL_ERROR
    try:
        code = _diagnose_here(spec, json_out, debug, out, isolate=False)
    finally:
        launch.GROUP = None
        group.finish(code)
    return code


class _Progress:
    """Progress on stderr: a live status line on a terminal; otherwise one line per rung and
    at most one line a second per optimizer step (a CI log stays short)."""

    def __init__(self, err: Console, quiet: bool):
        self.err = err
        self.quiet = quiet
        self.status = err.status("loading the spec's code...") if err.is_terminal else None
        self.last_line = 0.0

    def __enter__(self):
        if self.status is not None:
            self.status.__enter__()
        return self

    def __exit__(self, *exc_info):
        if self.status is not None:
            self.status.__exit__(*exc_info)

    def __call__(self, event: dict) -> None:
        import time
        rung, precision, step = event.get("rung"), event.get("precision"), event.get("step")
        elapsed = f"{event.get('elapsed_s', 0):.1f}s"
        if precision is None:
            text = f"rung {rung}  ({elapsed})"
        else:
            of = f"/{event['steps']}" if event.get("steps") else ""
            text = f"rung {rung}  {precision}  optimizer step {step}{of}  ({elapsed})"
        if self.status is not None:
            self.status.update(text)
            return
        if self.quiet:
            return
        now = time.monotonic()
        if precision is None or step == 0 or now - self.last_line >= 1.0:
            self.last_line = now
            self.err.print(f"  {text}", highlight=False, markup=False)


def _isolated() -> bool:
    """Run the loop in a child process (the default). `AMPDOCTOR_IN_PROCESS=1` runs it in this
    process instead: for a debugger (`breakpoint()` in the loop needs the terminal), with no
    watchdog beyond the loop's own SIGALRM stop."""
    return os.environ.get("AMPDOCTOR_IN_PROCESS", "").strip().lower() not in ("1", "true", "yes")


def _writable_out(out: Path | None) -> Path:
    """The records folder as an absolute path (a loop that changes the working directory
    cannot move it), checked before any rung runs: UsageError when it cannot be written."""
    from . import record as records
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


def _diagnose_here(spec, json_out: bool, debug: bool, out: Path | None,
                   isolate: bool = True) -> int:
    from .report.terminal import render
    from .runner import error_record
    from .supervise import ChildCrashed

    err = _stderr()
    try:
        out = _writable_out(out)
    except UsageError as exc:
        return _fail(exc, debug)
    done: list[dict] = []
    try:
        with _Progress(err, quiet=json_out) as progress, _signals_interrupt():
            if isolate and _isolated():
                record, exception = _run_isolated(spec, progress, done, err)
            else:
                from .api import diagnose as run
                with contextlib.redirect_stdout(sys.stderr):
                    result = run(spec, save=False, on_done=lambda r: done.append(r.to_dict()),
                                 on_progress=progress)
                record, exception = result.data, result.exception
    except (KeyboardInterrupt, Interrupted) as exc:
        # Like a finished run: the terminal restored (the status spinner has exited), the
        # run stopped (its process killed, or torch restored in this one), and a record
        # saying where it stopped.
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        name = signal.Signals(signum).name
        error = UserCodeError(f"interrupted by {name} after {len(done)} rung(s); the record "
                              "holds the rungs that finished", cause=exc)
        record = error_record(spec, error)
        record["rungs"] = done
        err.print(f"ampdoctor: interrupted by {name}; the run was stopped.", markup=False)
        _save_and_show(record, out, json_out, render, err, 128 + int(signum))
        return 128 + int(signum)
    except (SpecError, LaunchError) as exc:
        return _fail(exc, debug)
    except ChildCrashed as exc:     # a bug in ampdoctor, in the process that ran the loop
        if debug and exc.remote_traceback:
            sys.stderr.write(inert(exc.remote_traceback))
        return _internal(exc, False)
    except Exception as exc:  # a bug in ampdoctor itself
        return _internal(exc, debug)
    if record is None:            # stopped by an error before there was anything to record
        return _fail(exception, debug)
    from . import record as records
    code = records.exit_code(record)
    if exception is not None:
        code = _fail(exception, debug)
    elif debug:
        for finding in record.get("findings", []):
            if finding.get("traceback"):
                err.print(inert(f"traceback of the {finding.get('kind')} in rung "
                                f"{finding.get('rung')}:"), markup=False, highlight=False)
                sys.stderr.write(inert(finding["traceback"]))
    if not _save_and_show(record, out, json_out, render, err, code):
        return UsageError.exit_code
    return code


def _run_isolated(spec, progress, done: list[dict], err: Console):
    """The diagnose in a child process (`supervise.run`): its events drive the progress line,
    its output goes to stderr."""
    from . import supervise
    from .spec import to_wire

    def on_event(event: dict) -> None:
        kind = event.pop("event", None)
        if kind == "progress":
            progress(event)
        elif kind == "done":
            done.append(event.get("rung") or {})

    def on_output(text: str) -> None:
        if progress.status is not None:
            err.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        else:
            sys.stderr.write(text)
            sys.stderr.flush()

    outcome = supervise.run(spec, to_wire(spec), on_event, on_output)
    return outcome.record, outcome.error


class Interrupted(AmpdoctorInterrupt):
    """SIGTERM or SIGHUP during a diagnose: handled like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt():
    """SIGTERM and SIGHUP raise Interrupted in the main thread while a diagnose runs."""
    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {}
    for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)):
        if sig is not None:
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:   # not the main thread
                pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _stdout_console() -> Console:
    """The terminal wraps what it shows; piped or redirected output gets whole lines (one
    finding's message on one line, greppable), never a wrap at 80 columns."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=100_000, no_color=True)


def _save_and_show(record, out, json_out, render, err, code: int) -> bool:
    """Save the record (its `exit_code` the process's), then show it; False (and a clear
    line) when it could not be saved (exit 2, which the record shown says)."""
    from . import record as records
    record["exit_code"] = code
    try:
        path = records.save(record, out)
        saved = True
    except OSError as exc:
        record["exit_code"] = UsageError.exit_code
        saved = False
        problem = f"ampdoctor: usage error: could not save the record under {out or records.DEFAULT_DIR}: {exc}"
    if json_out:
        sys.stdout.write(records.dumps(record))
    else:
        render(record, _stdout_console())
    if saved:
        err.print(inert(f"record saved to {path}"), highlight=False, markup=False,
                  style="dim")
    else:
        err.print(inert(problem), highlight=False, markup=False, style="bold red")
    return saved


@app.command()
def report(
    record: Optional[Path] = typer.Argument(None, help="A saved run record (default: the latest)."),
    html: bool = typer.Option(False, "--html", help="Write a self-contained HTML postmortem."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Where to write the HTML."),
    json_out: bool = typer.Option(False, "--json", help="Print the record as JSON on stdout."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder of run records."),
    record_code: bool = typer.Option(False, "--record-exit-code",
                                     help="Exit with the record's own code (1 failed, 3 error) "
                                     "instead of 0 once rendered."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Re-render a saved run record (no torch needed).

    Exit 0 once rendered (a postmortem step does not fail because the run it shows failed;
    --record-exit-code keeps the record's code), 2 for a missing or invalid record or clashing
    options.
    """
    from . import record as records
    from .report.terminal import render
    clash = ("-o/--output writes the HTML page: add --html" if output is not None and not html
             else "--html and --json: choose one" if html and json_out else None)
    if clash:
        raise typer.Exit(_fail(UsageError(clash + "."), debug))
    try:
        path = record if record is not None else records.latest(out)
        data = records.load(path)
        if int(data.get("record_version") or 1) > records.RECORD_VERSION:
            _stderr().print(inert(f"note: {path} was written by a newer ampdoctor (record "
                                  f"version {data['record_version']}, ampdoctor "
                                  f"{data.get('ampdoctor_version') or '?'}); shown with what "
                                  f"ampdoctor {__version__} knows of it.", limit=FIELD_LIMIT),
                            highlight=False, markup=False)
        if html:
            from .report.html import write_html
            target = output or Path(path).with_suffix(".html")
            write_html(data, target)
            _stderr().print(inert(f"HTML report written to {target}"), highlight=False,
                            markup=False)
        elif json_out:
            sys.stdout.write(records.dumps(data))
        else:
            render(data, _stdout_console())
    except AmpdoctorError as exc:
        raise typer.Exit(_fail(exc, debug))
    except OSError as exc:
        raise typer.Exit(_fail(UsageError(f"cannot write the report: {exc}", cause=exc), debug))
    raise typer.Exit(records.exit_code(data) if record_code else 0)


@app.command()
def scan(
    paths: list[Path] = typer.Argument(..., help="Files and folders to search."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    fmt: str = typer.Option("text", "--format", help="text, json or sarif."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write to this file."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Search code and configs for more than one loss-scale owner (never runs them)."""
    if fmt not in ("text", "json", "sarif"):
        raise typer.Exit(_fail(UsageError(f"--format must be text, json or sarif, not {fmt!r}."),
                               debug))
    if json_out and fmt not in ("text", "json"):
        raise typer.Exit(_fail(UsageError(f"--json and --format {fmt}: choose one."), debug))
    from .scan.command import run_scan
    raise typer.Exit(run_scan([str(p) for p in paths], as_json=json_out or fmt == "json",
                              fmt="json" if json_out else fmt,
                              output=str(output) if output else None, debug=debug))


@app.command()
def explain(
    kind: Optional[str] = typer.Argument(None, help="A diagnosis kind, e.g. clip-before-unscale "
                                         "(none: list every kind)."),
    json_out: bool = typer.Option(False, "--json", help="Print the explanation as JSON."),
) -> None:
    """Explain a diagnosis kind: what it is, why it matters, how to fix it."""
    from rich.text import Text

    from .findings import CATALOGUE, RULES
    console = Console()
    if kind is None:
        if json_out:
            sys.stdout.write(json.dumps({k: e.title for k, e in CATALOGUE.items()}, indent=2)
                             + "\n")
            return
        for name, entry in CATALOGUE.items():
            console.print(Text.assemble((f"{name:32}", "bold"), entry.title))
        return
    entry = CATALOGUE.get(kind)
    if entry is None:
        import difflib
        close = difflib.get_close_matches(kind, list(CATALOGUE), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise typer.Exit(_fail(UsageError(f"unknown kind {kind!r}.{hint} Kinds: "
                                          f"{', '.join(CATALOGUE)}"), False))
    rule = RULES.get(kind)
    if json_out:
        sys.stdout.write(json.dumps({
            "kind": entry.name, "title": entry.title, "why": entry.why,
            "example": entry.example, "fix": entry.fix,
            "measured": rule.measured if rule else None,
            "decided_in": f"ampdoctor/{rule.decided_in}" if rule else None}, indent=2) + "\n")
        return
    # headings are ampdoctor's markup; the texts are printed literally
    sections = [(f"{entry.name}", entry.title), ("Why is this bad?", entry.why),
                ("Example", entry.example), ("Fix", entry.fix)]
    if rule is not None:
        sections += [("Measured", rule.measured), ("Decided in", f"ampdoctor/{rule.decided_in}")]
    for heading, body in sections:
        if body:
            console.print(Text(heading, style="bold"))
            console.print(Text(body + "\n"))


@app.command()
def schema() -> None:
    """Print the spec's JSON Schema (for editors: the YAML language server completes and checks
    spec keys with it)."""
    from .spec import json_schema
    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")


@app.command()
def init(
    py_file: Optional[Path] = typer.Argument(None, help="Your training script: its loop, model "
                                             "and data functions fill the spec in (read, "
                                             "never run)."),
    output: Path = typer.Option(Path("triage.yaml"), "-o", "--output",
                                help="The spec to write (never overwritten)."),
) -> None:
    """Write a commented starter spec, filled in from PY_FILE when given."""
    from .init_spec import write_starter
    try:
        target, found = write_starter(output, py_file)
    except UsageError as exc:
        raise typer.Exit(_fail(exc, False))
    err = _stderr()
    err.print(inert(f"wrote {target}"), markup=False, highlight=False)
    if found is not None:
        missing = [k for k in ("train_loop", "model", "data") if getattr(found, k) is None]
        if missing:
            err.print(inert(f"fill in: {', '.join(missing)} (marked TODO); then run "
                            f"`ampdoctor diagnose {target}`"), markup=False, highlight=False)
        else:
            err.print(inert(f"next: ampdoctor diagnose {target}"), markup=False,
                      highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
