"""`ampdoctor demo [NAME] [--list]`: diagnose an example shipped with the package, so that a
plain `pip install` shows a diagnosis before the user writes a spec.

The examples live in `ampdoctor/examples/` (package data). `demo` copies one — its loop, the
shared `common.py` and its spec — into `.ampdoctor/demo/NAME/` under the working directory (a
fresh copy each time; a temporary folder when that cannot be written) and diagnoses the copy
exactly as `ampdoctor diagnose` would: the report names the copy's file and line, which the
user can open, edit and diagnose again with `ampdoctor diagnose .ampdoctor/demo/NAME/NAME.yaml`.
Exit codes are diagnose's (a broken example exits 1: that is its diagnosis), and 2 for an
unknown NAME.
"""

from __future__ import annotations

import difflib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import typer

from ..core.enums import KindId
from ..core.errors import UsageError
from .common import fail, stderr_console

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
DEFAULT = "broken_clip_before_unscale"
DEMO_DIR = Path(".ampdoctor") / "demo"


@dataclass(frozen=True)
class Example:
    name: str
    what: str
    expected: str           # the kind a diagnose finds, or "healthy"


EXAMPLES = (
    Example("healthy_sgd", "the textbook accumulation + AMP loop (SGD, GradScaler, zero_grad "
            "after the step)", "healthy"),
    Example("broken_clip_before_unscale", "clip_grad_norm_ before scaler.unscale_: the clip "
            "sees gradients times the loss scale", KindId.CLIP_BEFORE_UNSCALE),
    Example("broken_missing_average", "the loss is never divided by K: every update is K times "
            "too large", KindId.MISSING_ACCUMULATION_AVERAGE),
    Example("broken_scheduler_per_microbatch", "scheduler.step() on every micro-batch: warmup "
            "runs K times too fast", KindId.SCHEDULER_PER_MICROBATCH),
)


def example(name: str) -> Example:
    """The example called `name`; UsageError (exit 2) with the close names otherwise."""
    for item in EXAMPLES:
        if item.name == name:
            return item
    names = [e.name for e in EXAMPLES]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise UsageError(f"no example called {name!r}.{hint} The examples: {', '.join(names)} "
                     "(ampdoctor demo --list).")


def files_of(item: Example) -> list[Path]:
    """The shipped files one example needs: its loop, its spec and the shared `common.py`."""
    return [EXAMPLES_DIR / f"{item.name}.py", EXAMPLES_DIR / f"{item.name}.yaml",
            EXAMPLES_DIR / "common.py"]


def copy_example(item: Example, base: Path | None = None) -> Path:
    """Copy the example into `base/.ampdoctor/demo/NAME/` (default: the working directory),
    or a temporary folder when that cannot be written; the copied spec's path."""
    target = (base or Path.cwd()) / DEMO_DIR / item.name
    try:
        target.mkdir(parents=True, exist_ok=True)
        for file in files_of(item):
            shutil.copyfile(file, target / file.name)
    except OSError:
        target = Path(tempfile.mkdtemp(prefix=f"ampdoctor-demo-{item.name}-"))
        for file in files_of(item):
            shutil.copyfile(file, target / file.name)
    return target / f"{item.name}.yaml"


def _listing() -> str:
    width = max(len(e.name) for e in EXAMPLES)
    lines = ["Examples shipped with ampdoctor (ampdoctor demo NAME):"]
    for item in EXAMPLES:
        default = "  (the default)" if item.name == DEFAULT else ""
        lines.append(f"  {item.name:<{width}}  expect {item.expected}: {item.what}{default}")
    return "\n".join(lines)


def demo(
    name: str = typer.Argument(DEFAULT, help="The example to diagnose (see --list)."),
    list_: bool = typer.Option(False, "--list", help="List the examples and exit."),
    json_out: bool = typer.Option(False, "--json", help="Print the run record as JSON on "
                                  "stdout."),
    out: Path | None = typer.Option(None, "--out", help="Folder for run records "
                                    "(default .ampdoctor/runs)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Diagnose an example shipped with ampdoctor (one healthy loop, three broken ones): see a
    diagnosis before writing a spec of your own."""
    if list_:
        typer.echo(_listing())
        raise typer.Exit(0)
    try:
        item = example(name)
    except UsageError as exc:
        raise typer.Exit(fail(exc, debug)) from None
    spec = copy_example(item)
    err = stderr_console()
    shown = _shown(spec)
    err.print(f"ampdoctor demo: {item.name} ({item.what}); expect {item.expected}. The example "
              f"is copied to {shown.parent}: open the file the report names, edit it, and run "
              f"`ampdoctor diagnose {shown}` again.", markup=False, highlight=False)
    from .diagnose import run_diagnose
    code = run_diagnose(spec, json_out, debug, out)
    if code == 1 and item.expected != "healthy":
        err.print(f"ampdoctor demo: exit 1 is this example's expected result (a rung failed: "
                  f"{item.expected}).", markup=False, highlight=False, style="dim")
    raise typer.Exit(code)


def _shown(path: Path) -> Path:
    """`path` relative to the working directory when under it."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path
