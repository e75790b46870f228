"""Shell completion through typer's own protocol (the environment variables a shell's
completion script sets): `explain <TAB>` offers the kinds, `--rungs` the rung ids, and neither
imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ampdoctor.core.findings import RUNG_IDS
from ampdoctor.kinds import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
#: the CLI as the console script runs it, telling at exit whether torch was imported
PROGRAM = ("import atexit, sys; atexit.register(lambda: sys.stderr.write("
           "'torch imported' if 'torch' in sys.modules else 'no torch')); "
           "from ampdoctor.cli import app; app(prog_name='ampdoctor')")


def _complete(shell: str, words: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, _AMPDOCTOR_COMPLETE=f"complete_{shell}",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if shell == "bash":
        env.update(COMP_WORDS=words, COMP_CWORD=str(len(words.split()) - (
            0 if words.endswith(" ") else 1)))
    else:
        env["_TYPER_COMPLETE_ARGS"] = words
    return subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          env=env, timeout=60)


def test_explain_completes_the_kinds():
    every = _complete("bash", "ampdoctor explain ")
    assert every.stdout.split() == list(CATALOGUE)
    assert every.stderr.endswith("no torch")
    some = _complete("bash", "ampdoctor explain missing-")
    assert some.stdout.split() == [k for k in CATALOGUE if k.startswith("missing-")]
    assert some.stdout.split()          # (the catalogue has such kinds)
    # zsh shows each kind with its title
    zsh = _complete("zsh", "ampdoctor explain clip-before")
    assert '"clip-before-unscale":"Gradients are clipped while still scaled"' in zsh.stdout


def test_rungs_completes_each_item_of_the_list():
    every = _complete("bash", "ampdoctor diagnose triage.yaml --rungs ")
    assert every.stdout.split() == list(RUNG_IDS)
    assert every.stderr.endswith("no torch")
    second = _complete("bash", "ampdoctor diagnose triage.yaml --rungs fp32-accum,fp")
    # the items typed stay; one already given is not offered again
    assert second.stdout.split() == ["fp32-accum,fp16-scaler"]


def test_help_still_imports_no_torch():
    result = subprocess.run([sys.executable, "-c", PROGRAM.replace(
        "app(prog_name='ampdoctor')", "sys.argv[1:] = ['--help']; app(prog_name='ampdoctor')")],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "Usage" in result.stdout and result.stderr.endswith("no torch")
