"""The script's files under script mode (issue 34 item 5, `script.files`): the script's saves,
renames, removals, logs and listings behave as they do plainly, every file that existed before
the diagnose is unchanged byte for byte, and nothing the script wrote remains outside the run's
scratch folder.

The overlay is exercised in a fresh interpreter (it patches `os`, `io`, `shutil` and torch
there, as in a child run), then through the real CLI on a script that handles its files as
careful training scripts do (recipes/scripts/checkpoints.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampdoctor.script.infer import infer_reference
from conftest import RECIPES, ROOT, run_cli

CHECKPOINTS = RECIPES / "scripts" / "checkpoints.py"


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under `root`: relative path -> digest of its bytes ("dir")."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        found[key] = ("dir" if path.is_dir() and not path.is_symlink()
                      else hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def user_tree(root: Path) -> None:
    """A project folder as a user has it before the diagnose: an earlier run's outputs."""
    (root / "out" / "old_run").mkdir(parents=True)
    (root / "out" / "old_run" / "events.log").write_text("the old run's log\n")
    (root / "out" / "log.txt").write_text("step 9 loss 0.1 (an earlier run)\n")
    (root / "out" / "ckpt-1.pt").write_bytes(b"an earlier checkpoint")
    (root / "out" / "best.pt").write_bytes(b"the earlier best")
    (root / "out" / "metrics.json").write_text('{"step": 9}')
    (root / "data.bin").write_bytes(bytes(range(256)))


OPERATIONS = '''
import json, logging, os, shutil, sys, tempfile
from pathlib import Path
import torch
from safetensors import safe_open            # bound before the patches, as transformers does
from safetensors.torch import load_file, save_file
from ampdoctor.probe import patches
from ampdoctor.script import files

overlay = files.Overlay(sys.argv[1])
seen = {}
with patches.installed(lambda p: files.install(overlay, p)):
    os.chdir(sys.argv[2])
    with open("out/log.txt", "a") as f:                 # append: the original's lines kept
        f.write("appended\\n")
    seen["log"] = open("out/log.txt").read()
    fd = os.open("out/raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, b"raw"); os.close(fd)
    seen["raw"] = Path("out/raw.bin").read_bytes().decode()
    Path("out/config.txt").write_text("cfg")
    Path("out/best.pt").touch()
    torch.save({"w": 1}, "out/model.pt.tmp")
    os.replace("out/model.pt.tmp", "out/model.pt")
    seen["model"] = torch.load("out/model.pt")["w"]
    os.rename("out/ckpt-1.pt", "out/ckpt-1.bak")        # an original moved: copied, hidden
    seen["bak"] = open("out/ckpt-1.bak", "rb").read().decode()
    seen["ckpt_gone"] = not os.path.exists("out/ckpt-1.pt")
    os.remove("out/metrics.json")
    seen["metrics_gone"] = not Path("out/metrics.json").exists()
    shutil.rmtree("out/old_run")
    seen["old_run_gone"] = not os.path.isdir("out/old_run")
    os.makedirs("out/old_run/sub", exist_ok=True)       # made again: the old files stay hidden
    seen["old_run_new"] = sorted(os.listdir("out/old_run"))
    shutil.copytree("out/old_run", "out/copy")
    shutil.move("out/config.txt", "out/copy/config.txt")
    seen["listing"] = sorted(os.listdir("out"))
    seen["scandir"] = sorted((e.name, e.is_dir()) for e in os.scandir("out"))
    seen["glob"] = sorted(p.name for p in Path("out").glob("*.pt"))
    seen["walk"] = sorted(os.path.join(d, f) for d, _, fs in os.walk("out") for f in fs)
    handler = logging.FileHandler("out/train.log")
    logging.getLogger("t").addHandler(handler); logging.getLogger("t").warning("hello")
    handler.close()
    seen["logging"] = open("out/train.log").read()
    with tempfile.NamedTemporaryFile("w", delete=False) as t:
        t.write("tmp")
    seen["tmp_in_scratch"] = t.name.startswith(overlay.root)
    try:
        os.mkdir("out")
    except FileExistsError:
        seen["mkdir_exists"] = True
    try:
        open("nowhere/x.txt", "w")
    except FileNotFoundError:
        seen["no_folder"] = True
    os.makedirs("new/deep", exist_ok=True)
    Path("new/deep/f.txt").write_text("f")
    seen["new"] = Path("new/deep/f.txt").read_text()
    os.chdir("new")
    seen["chdir_read"] = Path("deep/f.txt").read_text()
    os.chdir(sys.argv[2])
    seen["data"] = len(Path("data.bin").read_bytes())
    # safetensors writes and reads its path from Rust (the HF Trainer's save_model): into a
    # folder the script made, which only the scratch holds
    os.makedirs("out/checkpoint-3", exist_ok=True)
    save_file({"w": torch.ones(2)}, "out/checkpoint-3/model.safetensors")
    seen["st_load"] = load_file("out/checkpoint-3/model.safetensors")["w"].tolist()
    with safe_open("out/checkpoint-3/model.safetensors", framework="pt") as f:
        seen["st_keys"] = list(f.keys())
    seen["report"] = overlay.report(sys.argv[2])
print(json.dumps(seen))
'''


def test_the_overlay_shows_the_script_its_own_writes_and_changes_nothing(tmp_path):
    user_tree(tmp_path / "project")
    before = tree(tmp_path / "project")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(OPERATIONS),
                             str(tmp_path / "scratch"), str(tmp_path / "project")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["log"] == "step 9 loss 0.1 (an earlier run)\nappended\n"
    assert (seen["raw"], seen["model"], seen["bak"]) == ("raw", 1, "an earlier checkpoint")
    assert seen["ckpt_gone"] and seen["metrics_gone"] and seen["old_run_gone"]
    assert seen["old_run_new"] == ["sub"]
    assert seen["listing"] == ["best.pt", "ckpt-1.bak", "copy", "log.txt", "model.pt",
                               "old_run", "raw.bin"]
    assert ["copy", True] in seen["scandir"] and ["model.pt", False] in seen["scandir"]
    assert seen["glob"] == ["best.pt", "model.pt"]
    assert seen["walk"] == ["out/best.pt", "out/ckpt-1.bak", "out/copy/config.txt",
                            "out/log.txt", "out/model.pt", "out/raw.bin"]
    assert seen["logging"] == "hello\n"
    assert seen["tmp_in_scratch"] and seen["mkdir_exists"] and seen["no_folder"]
    assert (seen["new"], seen["chdir_read"], seen["data"]) == ("f", "f", 256)
    assert seen["report"]["hidden"] == ["out/ckpt-1.pt", "out/metrics.json", "out/old_run"]
    assert "out/model.pt" in seen["report"]["written"]
    assert (seen["st_load"], seen["st_keys"]) == ([1.0, 1.0], ["w"])
    assert "out/checkpoint-3/model.safetensors" in seen["report"]["written"]
    # the user's folder: byte for byte as it was, nothing added
    assert tree(tmp_path / "project") == before


@pytest.mark.xdist_group("script_mode")
def test_a_careful_script_runs_as_plainly_and_leaves_the_project_as_it_was(tmp_path):
    plain = tmp_path / "plain"
    user_tree(plain)
    result = subprocess.run([sys.executable, str(CHECKPOINTS), "--steps", "3"], cwd=plain,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr    # plainly: it saves, moves and removes
    assert not (plain / "out" / "old_run").exists() and (plain / "out" / "ckpt-3.pt").exists()

    project = tmp_path / "project"
    user_tree(project)
    before = tree(project)
    inferred = infer_reference(str(CHECKPOINTS), [])
    record = run_cli("diagnose", CHECKPOINTS, "--json", "--out", tmp_path / "runs",
                     "--reference-args", shlex.join(inferred.args), "--", cwd=project)
    assert record.returncode == 0, record.stderr
    got = record.record
    assert got["verdict"] == "healthy" and got["findings"] == []
    assert {r["id"]: r["status"] for r in got["rungs"]}["fp32-accum"] == "pass"
    assert tree(project) == before                  # unchanged, and no file added
    note = next(n for n in got["notes"] if "scratch folder" in n)
    assert "out/ckpt-3.pt" in note and "out/old_run" in note
    scratch = note.split("scratch folder, ")[1].split(" ")[0]
    assert scratch.startswith(str(Path(shutil.os.environ.get("TMPDIR", "/tmp"))))
    assert not os.path.exists(scratch)              # removed with the session


BUILD = '''
import os, subprocess, sys
from pathlib import Path
from ampdoctor.probe import patches
from ampdoctor.script import files

overlay = files.Overlay(sys.argv[1])
with patches.installed(lambda p: files.install(overlay, p)):
    # as torch.utils.cpp_extension builds an op (DeepSpeed's shm op at its first initialize):
    # the build folder and its build.ninja from Python, then the compiler, another process,
    # reads them in the real folder and writes the library there
    build = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "some_op")
    os.makedirs(build, exist_ok=True)
    with open(os.path.join(build, "build.ninja"), "w") as f:
        f.write("rule cc")
    subprocess.run(["sh", "-c", "cat build.ninja > some_op.so"], cwd=build, check=True)
    print(Path(build, "some_op.so").read_text())
    # (a write anywhere else is still the scratch's)
    Path(sys.argv[2], "elsewhere.txt").write_text("x")
'''


def test_a_compiled_op_is_built_in_its_real_cache_folder(tmp_path):
    """torch's C++ extension folder (and Triton's cache) pass through the overlay: the compiler
    a build starts is another process and works in the real folder. (Redirected, the first
    DeepSpeed initialize of a machine failed in every run: FileNotFoundError for its build
    folder.) Writes elsewhere are still redirected."""
    scratch, project, cache = tmp_path / "scratch", tmp_path / "project", tmp_path / "ext"
    project.mkdir()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", BUILD, str(scratch), str(project)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rule cc"
    assert (cache / "some_op" / "build.ninja").read_text() == "rule cc"
    assert (cache / "some_op" / "some_op.so").read_text() == "rule cc"
    assert not (project / "elsewhere.txt").exists()
    assert (scratch / str(project / "elsewhere.txt").lstrip("/")).read_text() == "x"
