"""The typer app: the commands (one module each), `--version`, and the help's exit codes.

Exit codes (CONTRACT §5): 0 healthy, 1 a rung failed, 2 bad spec or usage, 3 the user's code
could not run. Nothing here imports torch: `ampdoctor --help` stays fast; torch is imported
only once a diagnose starts.
"""

from __future__ import annotations

import typer

from .._version import __version__
from .demo import demo
from .diagnose import diagnose
from .env import env
from .explain import explain
from .export_test import export_test
from .init import init
from .report import report
from .scan import scan
from .schema import schema

app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  help="Triage PyTorch training that combines gradient accumulation with mixed "
                       "precision (fp16 + GradScaler, or bf16).",
                  epilog="Exit codes (diagnose, demo): 0 healthy (warnings allowed, unless "
                         "--strict), 1 a rung failed, "
                         "2 bad spec or usage, 3 your model, data or loop could not run (or "
                         "hung, or exited), 4 an internal ampdoctor error; 128 + N after "
                         "signal N (Ctrl-C 130, SIGTERM 143). scan: 0 nothing found, 1 more "
                         "than one loss-scale owner (or, with --strict, a static hint), 2 a bad "
                         "path. report, export-test: 0 rendered or written, 2 a missing or invalid "
                         "record.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ampdoctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_callback(version: bool = typer.Option(False, "--version", callback=_version,
                                               is_eager=True,
                                               help="Print the version and exit.")) -> None:
    """ampdoctor: find the line that breaks accumulation + AMP."""


# `--help` lists the commands in this order
for command in (diagnose, report, scan, explain, schema, init, env, demo):
    app.command()(command)
app.command("export-test")(export_test)


def main() -> None:
    app()
