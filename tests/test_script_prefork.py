"""Script mode's start-up paid once (script/prefork.py): which imports the fork server takes on,
that a run's DataLoader workers start as in a plain run, and that a preloaded library's own
reference to a patched torch function still reaches the probe."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from ampdoctor.probe.events import Clip
from ampdoctor.script import child, prefork, spawn

pytestmark = pytest.mark.xdist_group("script_mode")


def test_the_server_takes_libraries_only(tmp_path):
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "pkg").mkdir()
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, argparse
        import torch, torch.nn as nn
        import numpy as np
        import yaml
        from PIL import Image
        from transformers import ViTConfig, ViTModel
        from . import sibling
        import helpers
        from pkg import thing
        import no_such_library_anywhere

        def main():
            from numpy import linalg
    """))
    got = prefork.script_imports(str(script), str(tmp_path))
    assert got == ["numpy", "yaml", "PIL:Image", "transformers:ViTConfig",
                   "transformers:ViTModel", "numpy:linalg"]


def test_an_unparsable_script_preloads_nothing(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("def (:\n")
    assert prefork.script_imports(str(script), str(tmp_path)) == []


def _run(script: Path, cwd: Path, **job) -> child.Outcome:
    return spawn.run_child(child.Job(script=str(script), args=[], precision="fp32", steps=2,
                                     cwd=str(cwd), env=dict(os.environ), **job),
                           120, "fp32 run")


def test_dataloader_workers_start_the_way_a_plain_run_starts_them(tmp_path):
    script = tmp_path / "loader.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Rows(Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                return torch.full((4,), float(i)), multiprocessing.get_start_method()

        net = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, how in DataLoader(Rows(), batch_size=8, num_workers=1):
            if set(how) != {multiprocessing.get_all_start_methods()[0]}:
                raise RuntimeError(f"workers started by {set(how)}")
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
    """))
    out = _run(script, tmp_path)
    assert out.error is None, out.error
    assert out.ended == "stopped" and len(out.steps) == 2


def test_a_preloaded_librarys_alias_of_a_patched_function_reaches_the_probe(tmp_path,
                                                                            monkeypatch):
    lib = tmp_path / "site"
    lib.mkdir()
    (lib / "cliplib_for_prefork_test.py").write_text(textwrap.dedent("""
        from torch.nn.utils import clip_grad_norm_

        def clip(params):
            return clip_grad_norm_(params, 0.5)
    """))
    monkeypatch.syspath_prepend(str(lib))   # (here; the fork server reads PYTHONPATH)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(lib), os.environ.get("PYTHONPATH", "")]))
    work = tmp_path / "work"
    work.mkdir()
    script = work / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import cliplib_for_prefork_test
        from ampdoctor.script import prefork

        if "cliplib_for_prefork_test" not in prefork.PRELOADED:
            raise RuntimeError("the library was not preloaded by the fork server")
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(5):
            net(torch.randn(8, 4)).sum().backward()
            cliplib_for_prefork_test.clip(net.parameters())
            opt.step()
            opt.zero_grad()
    """))
    assert prefork.script_imports(str(script), str(work)) == ["cliplib_for_prefork_test"]
    out = _run(script, work)
    assert out.error is None, out.error
    assert "cliplib_for_prefork_test" not in sys.modules   # imported by the server, not here
    clips = [e for e in out.events if isinstance(e, Clip)]
    assert len(clips) == 2 and {c.max_norm for c in clips} == {0.5}


def test_a_run_imports_the_frameworks_the_server_did_not_preload(tmp_path):
    """The server stops preloading at a library that starts a thread (and a run started
    without it preloads nothing): a run imports the script's frameworks itself before the
    probe's patches go in, so the Accelerator the script builds is watched. In a fresh
    interpreter: only the frameworks are imported, not the script's other libraries."""
    import subprocess
    script = Path(__file__).resolve().parents[1] / "recipes" / "scripts" / "accelerate_loop.py"
    probe = textwrap.dedent(f"""
        import sys
        from ampdoctor.script import prefork
        assert "accelerate" not in sys.modules
        prefork.import_frameworks({str(script)!r}, {str(tmp_path)!r})
        print("accelerate.accelerator" in sys.modules, "PIL" in sys.modules)
    """)
    pytest.importorskip("accelerate")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


def test_a_virtual_environment_inside_the_project_holds_libraries(tmp_path, monkeypatch):
    """A project's own `.venv` in the working directory: what is installed there is a library
    (preloaded by the server, its framework watched), not the user's own module."""
    site = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages"
    (site / "fakelib_for_prefork").mkdir(parents=True)
    (site / "fakelib_for_prefork" / "__init__.py").write_text("X = 1\n")
    (tmp_path / "own_module.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(tmp_path))
    script = tmp_path / "train.py"
    script.write_text("import fakelib_for_prefork\nimport own_module\n")
    assert prefork.script_imports(str(script), str(tmp_path)) == ["fakelib_for_prefork"]


@pytest.mark.parametrize("user", [None, "ACTIVE"])
def test_the_fork_server_waits_passively_unless_the_user_chose(monkeypatch, user):
    """Two runs side by side: OpenMP threads that spin while they wait took 4x as long on two
    cores (bench/README.md). The server starts with OMP_WAIT_POLICY=PASSIVE where the user
    set none (their own is kept), and removes it once torch has read it, so that no run sees
    a variable the user did not set."""
    from multiprocessing import forkserver

    if user is None:
        monkeypatch.delenv(prefork.WAIT_POLICY, raising=False)
    else:
        monkeypatch.setenv(prefork.WAIT_POLICY, user)
    seen: dict[str, str | None] = {}

    def ensure_running() -> None:
        seen.update(policy=os.environ.get(prefork.WAIT_POLICY),
                    marker=os.environ.get(prefork.PASSIVE_ENV))

    monkeypatch.setattr(forkserver._forkserver, "ensure_running", ensure_running)
    monkeypatch.setattr(prefork, "_SERVING", None)
    prefork.serve(None, ["numpy"])
    assert seen == ({"policy": "PASSIVE", "marker": "1"} if user is None
                    else {"policy": user, "marker": None})
    assert os.environ.get(prefork.WAIT_POLICY) == user       # this process: as it was
    assert prefork.PASSIVE_ENV not in os.environ
    # in the server, after torch's import: the policy serve set goes, the user's stays
    for key, value in seen.items():
        name = prefork.WAIT_POLICY if key == "policy" else prefork.PASSIVE_ENV
        if value is not None:
            monkeypatch.setenv(name, value)
    prefork.forget_wait_policy()
    assert os.environ.get(prefork.WAIT_POLICY) == user
    assert prefork.PASSIVE_ENV not in os.environ
