"""The front door: every option of `ampdoctor diagnose` works the same way for a spec and for
a script (script mode), or is refused with exit 2 and a message -- never accepted and ignored.

The table below has one entry per option `diagnose --help` lists; a new option without an
entry fails `test_every_option_has_a_check`. Each check runs the real CLI (the runs in the
watched worker process, as a user's) on a healthy spec and on a healthy script, with one
optimizer step and the fewest rungs the option allows, and asserts what the option does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import CONFIGS, RECIPES, run_cli

SPEC = CONFIGS / "healthy_sgd.yaml"
BROKEN_SPEC = CONFIGS / "broken_missing_average.yaml"
AMP = RECIPES / "scripts" / "amp_recipe.py"
AMP_REF = "--accum-steps 1 --batch-size 32 --amp"

pytestmark = pytest.mark.xdist_group("script_mode")

#: a script that prints on every micro-batch and warns once: what --verbose shows
NOISY = '''
import sys
import warnings
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
K = int(sys.argv[sys.argv.index("--accum") + 1]) if "--accum" in sys.argv else 4
bs = int(sys.argv[sys.argv.index("--bs") + 1]) if "--bs" in sys.argv else 4
warnings.warn("a warning of the script's own")
for i in range(len(data) // bs):
    x = data[i * bs:(i + 1) * bs]
    loss = (model(x) ** 2).mean() / K
    loss.backward()
    print(f"noisy print at micro-batch {i}")
    if (i + 1) % K == 0:
        opt.step()
        opt.zero_grad()
'''


def spec_run(tmp_path: Path, *options: str, spec: Path = SPEC):
    return run_cli("diagnose", spec, "--out", tmp_path / "runs", *options)


def script_run(tmp_path: Path, *options: str, bug: str = "none", script: Path = AMP,
               reference: str | None = AMP_REF, args: tuple[str, ...] = ("--amp",)):
    ref = ["--reference-args", reference] if reference is not None else []
    return run_cli("diagnose", script, "--out", tmp_path / "runs", *ref, *options, "--",
                   *args, "--bug", bug)


def saved(tmp_path: Path) -> dict:
    (path,) = sorted((tmp_path / "runs").glob("*.json"))
    return json.loads(path.read_text())


def fast(*rungs: str) -> tuple[str, ...]:
    return ("--steps", "1", "--rungs", ",".join(rungs or ("fp32-accum",)))


def both(check: Callable[[Path, Callable], None]) -> dict[str, Callable[[Path], None]]:
    """One check run on a spec and on a script: `run(tmp_path, *options)` is the mode's."""
    return {"spec": lambda tmp: check(tmp, spec_run),
            "script": lambda tmp: check(tmp, script_run)}


# ---------------------------------------------------------------- the checks, per option
def _json(tmp: Path, run: Callable) -> None:
    result = run(tmp, "--json", *fast())
    assert result.returncode == 0, result.stderr
    assert result.record["verdict"] == "healthy"
    assert result.record == saved(tmp)


def _out(tmp: Path, run: Callable) -> None:
    result = run(tmp, *fast())
    assert result.returncode == 0, result.stderr
    assert saved(tmp)["verdict"] == "healthy"
    assert str(tmp / "runs") in result.stderr        # "record saved to ..."


def _device(tmp: Path, run: Callable) -> None:
    result = run(tmp, "--json", "--device", "cpu", *fast())
    assert result.returncode == 0, result.stderr
    assert result.record["device"] == "cpu"
    bad = run(tmp, "--device", "tpu", *fast())
    assert bad.returncode == 2 and "--device" in bad.stderr and "'tpu' is not a device" \
        in bad.stderr


def _precisions(tmp: Path, run: Callable) -> None:
    result = run(tmp, "--json", "--steps", "1", "--precisions", "fp32,bf16", "--rungs",
                 "fp32-accum,fp16-scaler,skips")
    assert result.returncode == 0, result.stderr
    rungs = {r["id"]: r for r in result.record["rungs"]}
    for rung in ("fp16-scaler", "skips"):
        assert rungs[rung]["status"] == "skip"
        assert "fp16 is not in the spec's precisions" in rungs[rung]["summary"]
    bad = run(tmp, "--precisions", "fp32,fp8", *fast())
    assert bad.returncode == 2 and "--precisions" in bad.stderr


def _rungs(tmp: Path, run: Callable) -> None:
    result = run(tmp, "--json", *fast("fp32-accum", "double-scaling"))
    assert result.returncode == 0, result.stderr
    statuses = {r["id"]: r["status"] for r in result.record["rungs"]}
    assert statuses["fp32-accum"] == "pass" and statuses["double-scaling"] == "pass"
    others = [r for r in result.record["rungs"] if r["id"] not in ("fp32-accum",
                                                                   "double-scaling")]
    assert all(r["status"] == "skip" and "not among the rungs asked for" in r["summary"]
               for r in others)
    bad = run(tmp, "--rungs", "nosuch-rung")
    assert bad.returncode == 2 and "'nosuch-rung' is not a rung" in bad.stderr
    assert len(list((tmp / "runs").glob("*.json"))) == 1     # nothing ran: no new record


def _steps(tmp: Path, run: Callable) -> None:
    result = run(tmp, "--json", "--steps", "2", "--rungs", "fp32-accum")
    assert result.returncode == 0, result.stderr
    assert result.record["optimizer_steps"] == 2
    fp32 = next(r for r in result.record["rungs"] if r["id"] == "fp32-accum")
    assert fp32["details"]["steps_compared"] == 2
    bad = run(tmp, "--steps", "0")
    assert bad.returncode == 2 and "--steps" in bad.stderr


def _keep_going(tmp: Path, run: Callable) -> None:
    broken = (lambda *o: spec_run(tmp, *o, spec=BROKEN_SPEC)) if run is spec_run else \
        (lambda *o: script_run(tmp, *o, bug="no-average"))
    result = broken("--json", "--keep-going", "--steps", "1", "--rungs",
                    "fp32-accum,double-scaling")
    assert result.returncode == 1, result.stderr
    record = result.record
    assert record["failed_rung"] == "fp32-accum" and record["keep_going"] is True
    later = next(r for r in record["rungs"] if r["id"] == "double-scaling")
    assert later["status"] == "pass" and later["after_failure"] is True


def _strict(tmp: Path, run: Callable) -> None:
    result = run(tmp, "--json", "--strict", *fast())
    assert result.returncode == 0, result.stderr
    assert result.record["strict"] is True


def _junit(tmp: Path, run: Callable) -> None:
    result = run(tmp, "--junit", tmp / "junit.xml", *fast())
    assert result.returncode == 0, result.stderr
    text = (tmp / "junit.xml").read_text()
    assert "<testsuite" in text and 'name="fp32-accum"' in text


def _sarif(tmp: Path, run: Callable) -> None:
    result = run(tmp, "--sarif", tmp / "out.sarif", *fast())
    assert result.returncode == 0, result.stderr
    sarif = json.loads((tmp / "out.sarif").read_text())
    assert sarif["version"] == "2.1.0"
    assert sarif["runs"][0]["properties"]["verdict"] == "healthy"
    assert sarif["runs"][0]["invocations"][0]["exitCode"] == 0


def _debug(tmp: Path, run: Callable) -> None:
    # a bad value: --debug adds the traceback of the validation, the message stays
    bad = run(tmp, "--debug", "--rungs", "nosuch-rung")
    assert bad.returncode == 2 and "'nosuch-rung' is not a rung" in bad.stderr
    assert "Traceback" in bad.stderr
    plain = run(tmp, "--rungs", "nosuch-rung")
    assert "Traceback" not in plain.stderr


def _verbose_script(tmp: Path) -> None:
    script = tmp / "noisy.py"
    script.write_text(NOISY)

    def run(*options: str):
        return run_cli("diagnose", script, "--json", "--out", tmp / "runs", "--steps", "1",
                       "--rungs", "fp32-accum", "--reference-args", "--accum 1 --bs 16",
                       *options, "--", "--accum", "4", "--bs", "4")

    quiet = run()
    assert quiet.returncode == 0, quiet.stderr
    assert "noisy print" not in quiet.stderr and "a warning of the script's own" \
        not in quiet.stderr
    kept = "".join(o["text"] for o in quiet.record["output"])
    assert "noisy print at micro-batch 0" in kept and "a warning of the script's own" in kept
    loud = run("--verbose")
    assert loud.returncode == 0, loud.stderr
    assert "noisy print at micro-batch 0" in loud.stderr
    assert "output" not in loud.record


def _verbose_spec(tmp: Path) -> None:
    # a spec's loop output (the loop of tests/user_code.py's print recipe is not needed: the
    # flag's effect is where the output goes) -- kept in the record, shown with --verbose
    loop = tmp / "loopy.py"
    loop.write_text(
        "import torch\n"
        "def make_model():\n    torch.manual_seed(0)\n    return torch.nn.Linear(4, 1)\n"
        "def data():\n    g = torch.Generator().manual_seed(0)\n"
        "    return torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)\n"
        "def train_loop(model, optimizer, micro_batches, run):\n"
        "    for i, (x, y) in enumerate(micro_batches):\n"
        "        print('loop print', i)\n"
        "        loss = ((model(x) - y) ** 2).mean() / run.accumulation_steps\n"
        "        loss.backward()\n"
        "        if (i + 1) % run.accumulation_steps == 0:\n"
        "            optimizer.step()\n            optimizer.zero_grad()\n")
    spec = tmp / "loopy.yaml"
    spec.write_text("model: loopy:make_model\ndata: loopy:data\ntrain_loop: loopy:train_loop\n"
                    "accumulation_steps: 2\nmicro_batch_size: 4\noptimizer: {name: SGD, lr: 0.1}\n")
    quiet = spec_run(tmp, "--json", *fast(), spec=spec)
    assert quiet.returncode == 0, quiet.stderr
    assert "loop print" not in quiet.stderr
    assert "loop print 0" in "".join(o["text"] for o in quiet.record["output"])
    loud = spec_run(tmp, "--json", "--verbose", *fast(), spec=spec)
    assert "loop print 0" in loud.stderr


def _reference_args(tmp: Path) -> None:
    refused = spec_run(tmp, "--reference-args", "--accum 1")
    assert refused.returncode == 2 and "for script mode" in refused.stderr
    used = script_run(tmp, "--json", *fast())
    assert used.returncode == 0, used.stderr
    assert used.record["reference_args"] == AMP_REF.split()
    assert used.record["reference_args_origin"] == "given"
    assert used.record["reference_args_inferred"] is False


def _script_args(tmp: Path) -> None:
    refused = run_cli("diagnose", SPEC, "--out", tmp / "runs", "--", "--lr", "1")
    assert refused.returncode == 2 and "a spec takes none" in refused.stderr
    used = script_run(tmp, "--json", *fast(), args=("--amp", "--lr", "0.01"))
    assert used.record["args"] == ["--amp", "--lr", "0.01", "--bug", "none"]


def _no_reference(tmp: Path) -> None:
    refused = spec_run(tmp, "--no-reference")
    assert refused.returncode == 2 and "for script mode" in refused.stderr
    both_given = script_run(tmp, "--no-reference", *fast())
    assert both_given.returncode == 2 and "give one of them" in both_given.stderr
    used = script_run(tmp, "--json", "--no-reference", *fast(), reference=None)
    assert used.returncode == 2, used.stderr            # nothing compared: inconclusive
    assert used.record["verdict"] == "inconclusive" and used.record["reference_args"] is None
    inferred = script_run(tmp, "--json", *fast(), reference=None)
    assert inferred.returncode == 0, inferred.stderr
    assert inferred.record["reference_args_origin"] == "inferred"
    assert inferred.record["reference_args_inferred"] is True      # the contract's name


CHECKS: dict[str, dict[str, Callable[[Path], None]]] = {
    "--json": both(_json),
    "--out": both(_out),
    "--device": both(_device),
    "--precisions": both(_precisions),
    "--rungs": both(_rungs),
    "--steps": both(_steps),
    "--keep-going": both(_keep_going),
    "--strict": both(_strict),
    "--junit": both(_junit),
    "--sarif": both(_sarif),
    "--debug": both(_debug),
    "--verbose": {"spec": _verbose_spec, "script": _verbose_script},
    "--reference-args": {"both": _reference_args},
    "SCRIPT_ARGS": {"both": _script_args},
    "--no-reference": {"both": _no_reference},
}


def _diagnose_options() -> set[str]:
    import typer.main

    from ampdoctor.cli import app
    command = typer.main.get_command(app).commands["diagnose"]  # type: ignore[attr-defined]
    names = set()
    for param in command.params:
        if param.param_type_name == "option":
            names.add(max(param.opts, key=len))
        elif param.name != "spec":
            names.add(param.name.upper())
    return names - {"--help"}


def test_every_option_has_a_check():
    assert _diagnose_options() == set(CHECKS)


@pytest.mark.parametrize("option, mode", [(o, m) for o, modes in CHECKS.items()
                                          for m in modes])
def test_the_option_works_in_every_mode(tmp_path, option, mode):
    CHECKS[option][mode](tmp_path)


def test_the_report_says_what_ran(tmp_path):
    """Terminal, JSON and HTML name the script, its args and the reference's args (and that
    they were given), not 'spec None'."""
    result = script_run(tmp_path, "--json", *fast())
    assert result.returncode == 0, result.stderr
    record = result.record
    assert record["script"] == str(AMP) and record["spec"] is None
    assert record["args"] == ["--amp", "--bug", "none"]
    assert record["reference_args"] == AMP_REF.split()
    assert record["reference_args_origin"] == "given"
    (path,) = sorted((tmp_path / "runs").glob("*.json"))
    shown = run_cli("report", path)
    assert shown.returncode == 0
    text = " ".join(shown.stdout.split())        # the terminal may wrap the line
    assert f"script: {AMP} --amp --bug none · reference: {AMP_REF} (given)" in text
    assert "found: 1 model (Sequential, 2,177 params), SGD" in text
    html = tmp_path / "page.html"
    assert run_cli("report", path, "--html", "-o", html).returncode == 0
    page = html.read_text()
    assert f"<dt>script</dt><dd><code>{AMP}</code></dd>" in page
    assert f"<dt>reference args</dt><dd><code>{AMP_REF}</code> (given)</dd>" in page
    assert "<dt>spec</dt>" not in page
