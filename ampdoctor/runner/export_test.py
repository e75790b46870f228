"""`ampdoctor export-test`: a diagnosis becomes a regression test in the user's repository.

The test file re-runs the diagnosis a record came from (a spec, a framework entry point, or a
script with its args and reference args), on the rungs it ran, on the CPU with a few optimizer
steps, through the pytest plugin (`ampdoctor.assert_fixed`), and asserts what a fixed tree gives:

- a failed record: a healthy verdict, and none of the kinds it found, at any severity (a kind
  whose consequence is smaller on another run may come back as a warning: still the bug);
- a healthy record (with or without warnings): a healthy verdict: no error of any kind;
- a record whose loop could not run (error) or compared nothing (inconclusive): a healthy
  verdict.

Paths are written relative to the test file, so the test runs from any working directory and
in a fresh clone. Torch-free: it only reads the record and writes text.
"""

from __future__ import annotations

import datetime
import json
import keyword
import os
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import processes
from ..core.errors import UsageError
from ..record import as_record

if TYPE_CHECKING:
    from ..record.model import RecordModel

#: the steps a guard re-runs (the ladder needs a few windows; more only costs CI time)
DEFAULT_STEPS = 3


def guarded_kinds(record: RecordModel | Mapping[str, Any]) -> list[str]:
    """The kinds a fixed tree must not show: the errors of a failed record (in order, once)."""
    record = as_record(record)
    if record.verdict != "failed":
        return []
    kinds: list[str] = []
    for finding in record.findings:
        if finding.severity == "error" and finding.kind not in kinds:
            kinds.append(finding.kind)
    return kinds


#: a rung skipped for one of these was left out by the diagnose's options or the spec itself
_LEFT_OUT = ("not among the rungs asked for", "is not in the spec's precisions")


def rung_ids(record: RecordModel | Mapping[str, Any]) -> list[str]:
    """The rungs the record ran, in order (those an earlier failure kept from running, or that
    the options left out, are not): what the guard runs again."""
    ids: list[str] = []
    for rung in as_record(record).rungs:
        rid = rung.id
        status, summary = rung.status, rung.summary
        if status == "not-run" or (status == "skip" and any(s in summary for s in _LEFT_OUT)):
            continue
        if rid and rid not in ids:
            ids.append(rid)
    return ids


def _relative(path: str, base: Path) -> str:
    """`path` relative to `base` (the test file's folder), `/`-separated; absolute when the two
    share nothing but the root (or not even that: another drive)."""
    full = os.path.abspath(path)
    try:
        if os.path.commonpath([full, str(base)]) == os.path.abspath(os.sep):
            return Path(full).as_posix()     # nothing in common but the root: as it is
        return Path(os.path.relpath(full, base)).as_posix()
    except ValueError:
        return Path(full).as_posix()


def _identifier(text: str) -> str:
    name = re.sub(r"\W+", "_", text.lower()).strip("_") or "run"
    return f"_{name}" if name[0].isdigit() or keyword.iskeyword(name) else name


def default_target(record: RecordModel | Mapping[str, Any], folder: Path) -> Path:
    """tests/test_ampdoctor_<name>.py under `folder` when it has a tests/ folder, else in it."""
    tests = folder / "tests"
    base = tests if tests.is_dir() else folder
    return base / f"test_ampdoctor_{_identifier(as_record(record).name or 'run')}.py"


def _what_it_found(record: RecordModel, base: Path) -> list[str]:
    """The docstring's lines on the finding(s) the test guards."""
    verdict = record.verdict
    lines: list[str] = []
    for finding in record.findings:
        if verdict == "failed" and finding.severity != "error":
            continue
        loc = finding.location
        where = (f" at {_relative(loc.file, base)}:{loc.line}" if loc and loc.file else "")
        lines.append(f"  {finding.severity} {finding.kind}{where} (rung {finding.rung})")
        message = " ".join(finding.message.split())
        if message:
            lines.append(f"      {message[:300]}")
    if verdict == "error" and record.error:
        message = " ".join(record.error.message.split())
        lines.append(f"  the training code could not run: {message[:300]}")
    if verdict == "inconclusive":
        lines.append(f"  inconclusive: {record.inconclusive or 'nothing was compared'}")
    return lines or ["  nothing: the run was healthy"]


def _docstring_safe(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _lit(value: str | list[str]) -> str:
    """A Python literal of a string or a list of strings (JSON's quoting is Python's)."""
    return json.dumps(value, ensure_ascii=False)


def _wrapped(text: str, width: int = 88) -> str:
    """Each paragraph line wrapped at `width`, its indentation kept."""
    out = []
    for line in text.split("\n"):
        indent = line[:len(line) - len(line.lstrip())]
        out.append(textwrap.fill(line, width, subsequent_indent=indent + "  " if indent else "",
                                 break_long_words=False, break_on_hyphens=False)
                   if line.strip() else "")
    return "\n".join(out)


def render(record: RecordModel | Mapping[str, Any], record_path: Path | None, target: Path,
           steps: int = DEFAULT_STEPS, today: datetime.date | None = None) -> str:
    """The text of the test file that guards `record`, to be written at `target`."""
    record = as_record(record)
    base = target.resolve().parent
    today = today or datetime.date.today()
    script, spec = record.script, record.spec
    if not script and not spec:
        raise UsageError("the record names neither a spec file nor a script (a diagnose of an "
                         "in-memory Spec from the Python API): nothing to re-run; export from a "
                         "record of `ampdoctor diagnose SPEC.yaml` or `ampdoctor diagnose "
                         "SCRIPT.py`.")
    rungs = rung_ids(record)
    kinds = guarded_kinds(record)
    name = record.name or "run"
    verdict = record.verdict
    call: list[str] = []
    if script:
        what = f"the script {_relative(str(script), base)}"
        call.append(f"script=HERE / {_lit(_relative(str(script), base))},")
        call.append(f"args={_lit(list(record.args or []))},")
        reference = record.reference_args
        origin = record.reference_args_origin or "given"
        if reference is not None and origin == "inferred" and (
                any(processes.REFERENCE_COPY_PREFIX in arg for arg in reference)
                or list(reference) == list(record.args or [])):
            call.append("# reference_args: inferred again (its config or literals at K = 1)")
        elif reference is not None:
            call.append(f"reference_args={_lit(list(reference))},  # {origin} in the diagnose")
        cwd = record.cwd
        if cwd:
            call.append(f"cwd=HERE / {_lit(_relative(str(cwd), base))},")
    else:
        what = f"the spec {_relative(str(spec), base)}"
        call.append(f"spec=HERE / {_lit(_relative(str(spec), base))},")
    every = [r.id for r in record.rungs]
    if rungs and rungs != every:      # (all of them: the ladder's own choice, kept so)
        call.append(f"rungs={_lit(rungs)},")
    call.append(f"steps={int(steps)},")
    call.append('device="cpu",')
    if kinds:
        call.append(f"kinds={_lit(kinds)},")
    if verdict == "failed":
        asks = ("a healthy verdict and none of: " + ", ".join(kinds) +
                ". It fails until the bug is fixed, then keeps it fixed.")
        test = f"test_{_identifier(name)}_keeps_{_identifier('_'.join(kinds[:2]))}_fixed"
    else:
        asks = "a healthy verdict (no error of any kind)."
        test = f"test_{_identifier(name)}_stays_healthy"
    found = "\n".join(_what_it_found(record, base))
    source = f" (record {record_path.name})" if record_path is not None else ""
    doc = _docstring_safe(_wrapped(
        f"What ampdoctor found on {today.isoformat()} in {name}{source}, verdict "
        f"{verdict}:\n\n{found}\n\nThis test re-runs that diagnosis ({what}, "
        f"rungs {', '.join(rungs) or 'all'}, {int(steps)} optimizer steps, on the CPU) and "
        f"asks for {asks}\n\nWritten by `ampdoctor export-test`; it needs only "
        "`pip install ampdoctor` (and what the training code imports)."))
    body = "\n".join(textwrap.fill(line, 96, initial_indent=" " * 8, subsequent_indent=" " * 12,
                                   break_long_words=False, break_on_hyphens=False)
                     for line in call)
    return (f'"""{doc}\n"""\n\nfrom pathlib import Path\n\nHERE = Path(__file__).resolve().parent'
            f"\n\n\ndef {test}(ampdoctor):\n    ampdoctor.assert_fixed(\n{body}\n    )\n")


def write(text: str, target: Path, force: bool) -> None:
    """Write the test file whole (a temporary file renamed over it), never over a file that is
    there unless `force`."""
    if target.exists() and not force:
        raise UsageError(f"{target} exists: choose another path with -o, or --force to replace "
                         "it.")
    if not target.parent.is_dir():
        raise UsageError(f"cannot write {target}: the folder {target.parent} does not exist.")
    tmp = target.with_name(f".{target.name}.ampdoctor-tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {target}: {exc.strerror or exc}", cause=exc) from exc


def guard_command(*, spec: str | os.PathLike[str] | None, script: str | os.PathLike[str] | None,
                  args: list[str], reference_args: list[str] | None, rungs: list[str] | None,
                  steps: int | None, device: str | None, out: Path) -> list[str]:
    """The `ampdoctor diagnose` command line a guard runs."""
    import shlex
    import sys
    if (spec is None) == (script is None):
        raise UsageError("assert_fixed: give one of spec= or script=.")
    target = os.fspath(script if script is not None else spec)   # type: ignore[arg-type]
    command = [sys.executable, "-m", "ampdoctor", "diagnose", target, "--json", "--out",
               str(out)]
    if device:
        command += ["--device", device]
    if steps is not None:
        command += ["--steps", str(int(steps))]
    if rungs:
        command += ["--rungs", ",".join(rungs)]
    if script is not None:
        if reference_args is not None:
            command += ["--reference-args", shlex.join(reference_args)]
        if args:
            command += ["--", *args]
    elif args or reference_args is not None:
        raise UsageError("assert_fixed: args= and reference_args= are a script's, not a "
                         "spec's.")
    return command


def judge_guard(record: RecordModel | Mapping[str, Any], kinds: list[str]) -> str | None:
    """Why the re-run diagnosis shows the tree not fixed (None: it is): not healthy, or a
    guarded kind back at any severity."""
    record = as_record(record)
    verdict = record.verdict
    back = sorted({f.kind for f in record.findings if f.kind in kinds})
    if verdict == "healthy" and not back:
        return None
    if verdict == "healthy":
        return f"{', '.join(back)} is back (as a warning): the bug this test guards"
    return {"failed": "the training loop is not fixed",
            "inconclusive": "the diagnosis compared nothing: it cannot say the loop is fixed",
            }.get(str(verdict), "the training code could not run")


def run_guard(*, spec: str | os.PathLike[str] | None = None,
              script: str | os.PathLike[str] | None = None, args: list[str] | None = None,
              reference_args: list[str] | None = None, cwd: str | os.PathLike[str] | None = None,
              rungs: list[str] | None = None, steps: int | None = DEFAULT_STEPS,
              device: str | None = "cpu", kinds: list[str] | None = None,
              out: Path) -> tuple[RecordModel | None, str | None]:
    """Re-run a diagnosis in a process of its own (`ampdoctor diagnose ... --json`, the same
    command a user types); the record and why the tree is not fixed (None: it is)."""
    import subprocess

    command = guard_command(spec=spec, script=script, args=list(args or []),
                            reference_args=(list(reference_args) if reference_args is not None
                                            else None),
                            rungs=list(rungs) if rungs else None, steps=steps, device=device,
                            out=out)
    proc = subprocess.run(command, cwd=os.fspath(cwd) if cwd is not None else None,
                          capture_output=True, text=True, check=False,
                          env=dict(os.environ, NO_COLOR="1"))
    try:
        record = as_record(json.loads(proc.stdout))
    except (ValueError, TypeError, UsageError):   # not JSON, or JSON that is not a record
        record = None
    if record is None:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return None, (f"ampdoctor could not re-run the diagnosis (exit {proc.returncode}): "
                      f"{' '.join(command[1:])}\n{tail}")
    why = judge_guard(record, list(kinds or []))
    return record, None if why is None else f"{why}\n{record.summary()}"
