"""Hostile input: a shared postmortem never runs what a record holds, records are never lost,
and the tool never writes into the user's tree.

(The HTML checks parse the page with a real HTML parser and list every element and attribute it
holds; a headless-browser check is not part of this suite yet.)
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ampdoctor import record as records
from ampdoctor.report.html import render_html
from conftest import CONFIGS, RECIPES, run_cli, run_cli_process

HOSTILE = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "</title><script src=https://evil.example/x.js></script>",
    "javascript:alert(1)",
    "<svg onload=alert(1)>",
    "{{ 7*7 }}{% for x in range(3) %}x{% endfor %}",
    "[/]",
    "[bold red]markup[/]",
    "<style>body{background:url(https://evil.example/)}</style>",
]

#: The elements the postmortem template itself writes; anything else came from a record.
TEMPLATE_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "span", "dl",
                 "dt", "dd", "code", "pre", "table", "thead", "tbody", "tr", "th", "td", "div",
                 "p", "strong",
                 "ul", "li", "svg", "polyline", "g", "circle", "details", "summary",
                 # the charts: matplotlib's SVG, and the page's figures and source snippets
                 "figure", "figcaption", "section", "i", "defs", "path", "use", "text",
                 "tspan", "rect", "clippath"}


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.text: list[str] = []
        self.styles = 0

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))
        self.styles += tag == "style"

    def handle_data(self, data):
        self.text.append(data)


def _hostile_record(text: str) -> dict:
    return {
        "record_version": 1, "ampdoctor_version": text, "spec": f"/tmp/{text}/spec.yaml",
        "name": text, "device": text, "accumulation_steps": text, "verdict": "failed",
        "failed_rung": text, "notes": [text],
        "environment": {"host": text, "git_commit": text, "spec_text": text, "python": text},
        "error": {"type": text, "message": text, "exit_code": 3},
        "rungs": [{"id": text, "status": text, "summary": text, "seconds": 0.5}],
        "findings": [{"rung": text, "kind": text, "severity": text, "message": text,
                      "title": text, "fix": text,
                      "evidence": {text: text, "measured": text},
                      "location": {"file": text, "line": 3, "code": text},
                      "source": {"file": text, "start": 2, "line": 3, "lines": [text, text]},
                      "traceback": text}],
        "runs": [{"rung": text, "precision": text, "label": text, "step": [0, 1],
                  "ratio": [1.0, 4.0], "bad": [False, True], "band": [0.9, 1.1],
                  "scale": [8.0, 4.0], "skipped": [False, True],
                  "grad_norm_before_unscale": [8.0, 3.0], "grad_norm_after_unscale": [1.0, 0.7]}],
        "series": {"scale": [1.0, 2.0], "skipped": [False, True],
                   "grad_norm_before_unscale": [], "grad_norm_after_unscale": []},
    }


@pytest.mark.parametrize("text", HOSTILE)
def test_the_postmortem_escapes_every_record_field(text):
    page = render_html(_hostile_record(text))
    parsed = _Elements()
    parsed.feed(page)
    tags = {tag for tag, _ in parsed.tags}
    assert tags <= TEMPLATE_TAGS, tags - TEMPLATE_TAGS
    # the template's own stylesheet, and matplotlib's one per chart (fixed, no user text)
    assert parsed.styles == 1 + sum(tag == "svg" for tag, _ in parsed.tags)
    for tag, attrs in parsed.tags:
        for name, value in attrs:
            assert not name.startswith("on"), (tag, name)
            assert "evil.example" not in (value or ""), (tag, name, value)
            assert "javascript:" not in (value or ""), (tag, name, value)
    # the text survives, as text: a reader sees exactly what the record said
    assert any(text in chunk for chunk in parsed.text)
    # a template payload is not evaluated (the charts' SVG coordinates aside)
    import re
    prose = re.sub(r"<svg.*?</svg>", "", page, flags=re.S)
    assert "49" not in prose or "{{ 7*7 }}" in "".join(parsed.text)


def _save_many(out: str, count: int) -> None:
    for _ in range(count):
        records.save({"name": "race", "verdict": "healthy"}, Path(out))


def test_two_processes_saving_at_once_lose_no_record(tmp_path):
    out = tmp_path / "runs"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_save_many, args=(str(out), 25)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    saved = sorted(out.glob("*.json"))
    assert len(saved) == 50                                        # none replaced another
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left
    assert all(json.loads(p.read_text())["name"] == "race" for p in saved)


def test_report_passes_over_debris_to_the_latest_real_record(tmp_path):
    out = tmp_path / "runs"
    real = records.save({"name": "real", "verdict": "failed", "rungs": [], "findings": []}, out)
    time.sleep(0.01)
    (out / ".tmp-abc123.part").write_text("")          # a save killed mid-write
    (out / ".tmp-old.json").write_text("")             # debris of an older version
    (out / "zz-not-a-record.json").write_text('{"some": "other tool"}')
    (out / "zz-truncated.json").write_text('{"verdict": "heal')
    for p in out.glob("zz-*"):
        os.utime(p, (time.time() + 5, time.time() + 5))   # newer than the real one
    assert records.latest(out) == real
    result = run_cli("report", "--out", out, "--json", "--record-exit-code")
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["name"] == "real"


@pytest.mark.parametrize("field, code", [(300, 3), (0, 3), (2, 2), (None, 3), ("x", 2)])
def test_a_records_own_exit_code_cannot_pick_reports_exit_code(tmp_path, field, code):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"verdict": "error", "error": {"exit_code": field,
                                                              "message": "m"}}))
    assert run_cli("report", path, "--record-exit-code").returncode == code
    # rendered: 0; an invalid record: 2
    assert run_cli("report", path).returncode == (2 if field == "x" else 0)


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_diagnose_and_scan_leave_the_users_tree_byte_for_byte(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("common.py", "healthy_sgd.py"):
        (project / name).write_text((RECIPES / name).read_text())
    spec = (CONFIGS / "healthy_sgd.yaml").read_text().replace("../recipes", str(project))
    (project / "spec.yaml").write_text(spec)
    before = _tree_digest(project)
    env = {"PYTHONDONTWRITEBYTECODE": ""}   # as on a machine that writes bytecode by default
    # (a process of its own: whether bytecode is written is the interpreter's default there)
    assert run_cli_process("diagnose", project / "spec.yaml", "--out", tmp_path / "runs",
                           env=env).returncode == 0
    assert run_cli_process("scan", project, env=env).returncode == 0
    assert _tree_digest(project) == before          # no __pycache__, nothing else


def test_a_failed_import_leaves_sys_path_and_modules_as_they_were(tmp_path):
    import sys

    from ampdoctor.core.errors import AmpdoctorError
    from ampdoctor.loading import UserCode
    from ampdoctor.probe.callsite import CallSiteFinder
    from ampdoctor.spec import load_spec

    project = tmp_path / "proj"
    project.mkdir()
    (project / "mymodel.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Linear(2, 1)\n"
    )
    (project / "myloop.py").write_text("raise ImportError('broken on purpose')\n")
    (project / "spec.yaml").write_text(
        "project_root: .\nmodel: mymodel:make\ndata: mymodel:make\n"
        "train_loop: myloop:train_loop\naccumulation_steps: 2\nmicro_batch_size: 2\n")
    spec = load_spec(project / "spec.yaml")
    path_before, modules_before = list(sys.path), set(sys.modules)
    with pytest.raises(AmpdoctorError):
        UserCode(spec, CallSiteFinder([spec.root]))
    assert sys.path == path_before
    # the user's modules are gone again; ampdoctor's own lazily imported modules may stay
    left = {m for m in set(sys.modules) - modules_before if not m.startswith("ampdoctor.")}
    assert left == set()
    assert "mymodel" not in sys.modules and "myloop" not in sys.modules
    assert not sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE")


# ------------------------------------------------------------------- specs that are bombs
def _alias_bomb(levels: int = 8) -> str:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(levels):
        prev, name = chr(97 + i), chr(98 + i)
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


BASE_SPEC = "model: m:m\ndata: m:d\ntrain_loop: m:l\naccumulation_steps: 2\n"


@pytest.mark.parametrize("name, text, message", [
    ("alias bomb", BASE_SPEC + "extra:\n" + "".join("  " + line + "\n"
                                                    for line in _alias_bomb().splitlines()),
     "expands to more than 100,000 values"),
    ("duplicate key", BASE_SPEC + "accumulation_steps: 4\n",
     "key 'accumulation_steps' is given twice (first on line 4)"),
    ("a bool for an int", BASE_SPEC.replace("accumulation_steps: 2", "accumulation_steps: true"),
     "spec key 'accumulation_steps': Input should be a valid integer"),
    ("a huge seed", BASE_SPEC + "seed: 99999999999999999999999\n",
     "spec key 'seed': Input should be less than or equal to 4294967295"),
    ("too many keys", BASE_SPEC + "".join(f"k{i}: 1\n" for i in range(5000)),
     "the spec has 5,004 top-level keys"),
    ("over a MiB", BASE_SPEC + "# " + "x" * (1024 * 1024) + "\n", "the spec is over 1024 KiB"),
])
def test_a_hostile_spec_is_one_clear_line_and_exit_2(tmp_path, name, text, message):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    started = time.monotonic()
    result = run_cli("diagnose", path, "--out", tmp_path / "runs", timeout=60)
    assert result.returncode == 2, (name, result.stderr)
    assert message in " ".join(result.stderr.split()), (name, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) < 40
    assert time.monotonic() - started < 20
    assert not (tmp_path / "runs").exists()     # a bad spec is not recorded


def test_many_unknown_keys_are_listed_up_to_a_bound(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(BASE_SPEC + "".join(f"unknown_{i}: 1\n" for i in range(150)))
    result = run_cli("diagnose", path)
    assert result.returncode == 2
    assert "... and 130 more problem(s)." in result.stderr
    assert len(result.stderr.splitlines()) < 80


def test_a_device_is_not_a_spec():
    result = run_cli("diagnose", "/dev/zero", timeout=30)
    assert result.returncode == 2
    assert "is not a regular file" in result.stderr


def test_scan_skips_a_config_alias_bomb_quickly(tmp_path):
    (tmp_path / "cfg.yaml").write_text("fp16: true\n" + _alias_bomb())
    started = time.monotonic()
    result = run_cli("scan", tmp_path, timeout=60)
    assert result.returncode == 0
    assert "expands to more than 100,000 values" in result.stdout
    assert time.monotonic() - started < 20


# --------------------------------------------------------------- loops that leave early
EXITING = '''
import sys
import torch


def make():
    return torch.nn.Linear(4, 1)


def data():
    return torch.randn(16, 4), torch.randn(16, 1)


def exits_0(model, optimizer, micro_batches, run):
    sys.exit(0)  # LINE


def exits_msg(model, optimizer, micro_batches, run):
    sys.exit("stopping early")  # LINE


def generator_exit(model, optimizer, micro_batches, run):
    raise GeneratorExit()  # LINE


def data_exits():
    sys.exit(0)  # LINE


def hard_exit(model, optimizer, micro_batches, run):
    import os
    os._exit(0)  # LINE


class Stop(BaseException):
    pass


def base_exception(model, optimizer, micro_batches, run):
    raise Stop("a BaseException of the user's own")  # LINE
'''


@pytest.mark.parametrize("loop, data", [("exits_0", "data"), ("exits_msg", "data"),
                                        ("generator_exit", "data"), ("exits_0", "data_exits"),
                                        ("base_exception", "data"), ("hard_exit", "data")])
def test_a_loop_or_factory_that_exits_is_a_user_code_error_with_a_record(tmp_path, loop, data):
    (tmp_path / "leaving.py").write_text(EXITING)
    source = EXITING.splitlines()

    def marked(name: str) -> int:   # the `# LINE` after `def name(`
        start = next(n for n, text in enumerate(source) if f"def {name}(" in text)
        return next(n for n in range(start, len(source)) if "# LINE" in source[n]) + 1

    path = tmp_path / "spec.yaml"
    path.write_text(f"project_root: .\nmodel: leaving:make\ndata: leaving:{data}\n"
                    f"train_loop: leaving:{loop}\naccumulation_steps: 2\nmicro_batch_size: 4\n"
                    "optimizer_steps: 2\ndevice: cpu\n")
    # os._exit would end this process: that one runs in a process of its own
    run = run_cli_process if loop == "hard_exit" else run_cli
    result = run("diagnose", path, "--json", "--out", tmp_path / "runs")
    assert result.returncode == 3, result.stderr       # never 0: nothing was judged
    record = result.record
    assert record["verdict"] == "error"
    assert list((tmp_path / "runs").glob("*.json"))
    failing = data if data == "data_exits" else loop
    assert f"leaving.py:{marked(failing)}" in " ".join(result.stderr.split())


# --------------------------------------------------------- records rendered on a terminal
@pytest.mark.parametrize("text", ["[/data/a.bin]", "[/]", "[bold]x[/bold]", "[rung] kept"])
def test_the_terminal_prints_record_text_literally(tmp_path, text):
    record = _hostile_record(text)
    for rung in record["rungs"]:
        rung["status"] = "fail"
    record["findings"][0].update(severity="error", kind="gradient-mismatch", rung="fp32-accum")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    result = run_cli("report", path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "MarkupError" not in result.stderr
    shown = result.stdout
    assert shown.count(text) >= 4          # the name, a summary, the message, the fix...
    assert "[fp32-accum]" in shown          # the panel title keeps its [rung]


@pytest.mark.parametrize("record, field", [
    ({"verdict": "failed", "rungs": [{"id": "a", "status": "fail", "seconds": "slow"}]},
     "rungs.0.seconds"),
    ({"verdict": "failed", "rungs": "abc"}, "rungs"),
    ({"verdict": "failed", "findings": [{"rung": "a", "severity": "error"}]}, "findings.0.kind"),
    ({"verdict": "maybe"}, "verdict"),
    ({"verdict": "failed", "findings": [{"rung": "a", "kind": "k", "severity": "error",
                                         "location": {"file": "f", "line": "x"}}]},
     "findings.0.location.line"),
    ({"verdict": "failed", "series": {"scale": ["x"]}}, "series.scale.0"),
])
def test_a_record_that_breaks_the_schema_is_exit_2_naming_the_field(tmp_path, record, field):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    for extra in ([], ["--json"], ["--html", "-o", str(tmp_path / "p.html")]):
        result = run_cli("report", path, *extra)
        assert result.returncode == 2, (extra, result.stderr)
        assert f"field '{field}'" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_a_deeply_nested_record_is_exit_2(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"verdict": "failed", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = run_cli("report", path)
    assert result.returncode == 2
    assert "not a readable ampdoctor run record" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_record_from_a_newer_version_says_so(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"verdict": "healthy", "record_version": 99,
                                "ampdoctor_version": "9.0", "new_key": {"a": 1}}))
    result = run_cli("report", path)
    assert result.returncode == 0
    assert "written by a newer ampdoctor (record version 99" in " ".join(result.stderr.split())


# ------------------------------------------------------------- hangs and interruptions
HANGING = '''
import torch


def make():
    return torch.nn.Linear(4, 1)


def data():
    return torch.randn(16, 4), torch.randn(16, 1)


def train_loop(model, optimizer, micro_batches, run):
    K = run.accumulation_steps
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")
    for i, (x, y) in enumerate(micro_batches):
        with torch.autocast(run.device_type, dtype=run.autocast_dtype,
                            enabled=run.autocast_dtype is not None):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) / K
        try:
            scaler.scale(loss).backward()
        except Exception:
            pass
        while run.precision == "bf16" and i == 2:
            pass  # HANG
        if (i + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
'''


def _hanging_project(tmp_path: Path, timeout_s: float) -> Path:
    (tmp_path / "hang.py").write_text(HANGING)
    path = tmp_path / "spec.yaml"
    path.write_text("project_root: .\nmodel: hang:make\ndata: hang:data\n"
                    "train_loop: hang:train_loop\naccumulation_steps: 2\nmicro_batch_size: 4\n"
                    f"optimizer_steps: 2\ndevice: cpu\ntimeout_s: {timeout_s}\n")
    return path


def test_a_hanging_loop_is_stopped_at_timeout_s_naming_the_rung_and_line(tmp_path):
    spec = _hanging_project(tmp_path, 10)
    started = time.monotonic()
    # timeout_s = 10 s: the rungs before the hang finish well inside it even in a cold process
    # on a loaded machine; the hang is stopped by the run's own SIGALRM at 10 s
    result = run_cli("diagnose", spec, "--json", "--out", tmp_path / "runs", timeout=120)
    assert result.returncode == 3, result.stderr
    assert time.monotonic() - started < 300   # stopped, not left to hang
    record = result.record
    assert (record["verdict"], record["failed_rung"]) == ("error", "bf16-no-scaler")
    finding = record["findings"][0]
    assert finding["kind"] == "loop-error"
    line = next(n for n, t in enumerate(HANGING.splitlines(), start=1) if "# HANG" in t) - 1
    assert finding["location"]["line"] == line
    assert finding["evidence"]["timeout_s"] == 10
    assert finding["evidence"]["last_event"] == "backward"
    assert "did not finish within timeout_s = 10 s" in finding["message"]


def test_sigterm_writes_a_record_and_restores_the_terminal(tmp_path):
    import signal
    import subprocess
    import sys

    from conftest import ampdoctor_command

    spec = _hanging_project(tmp_path, 600)
    out = tmp_path / "runs"
    env = dict(os.environ, NO_COLOR="1")
    proc = subprocess.Popen(ampdoctor_command() + ["diagnose", str(spec), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 90
    lines = []
    for line in proc.stderr:                   # wait until the ladder is under way
        lines.append(line)
        if re.search(r"rung \d+/\d+ bf16-no-scaler", line) or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM" in stderr
    assert "Traceback" not in stderr
    assert "\x1b[?25l" not in stdout + stderr or "\x1b[?25h" in stdout + stderr  # cursor back
    saved = list(out.glob("*.json"))
    assert len(saved) == 1
    record = json.loads(saved[0].read_text())
    assert record["verdict"] == "error"
    assert [r["id"] for r in record["rungs"]] == ["reproducibility", "fp32-accum"]
    assert "SIGTERM" in record["error"]["message"]
    assert sys.platform != "win32"


@pytest.mark.parametrize("where", ["file", "under-a-file", "proc"])
def test_an_out_folder_that_cannot_be_written_is_exit_2_before_any_rung(tmp_path, where):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    # (root writes anywhere but in /proc: the one unwritable folder a root test can name)
    out = {"file": blocker, "under-a-file": blocker / "runs",
           "proc": Path("/proc/ampdoctor-runs")}[where]
    result = run_cli("diagnose", CONFIGS / "healthy_sgd.yaml", "--out", out)
    assert result.returncode == 2
    assert f"--out {out}: the records folder cannot be written" in result.stderr
    assert "rung" not in result.stderr and result.stdout == ""    # reported before any rung
    assert blocker.read_text() == "not a folder"


# --------------------------------------------------------------------- clear messages
UNCLEAR = '''
import torch


def make():
    return torch.nn.Linear(4, 1)


def data():
    return torch.randn(16, 4), torch.randn(16, 1)


def opt_empty(model):
    return []


def opt_other(model):
    return torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1)


def loop_two_args(model, optimizer):
    pass


def loop_dtype(model, optimizer, micro_batches, run):
    torch.set_default_dtype(torch.float64)
    for x, y in micro_batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
'''


@pytest.mark.parametrize("extra, code, fragments", [
    ("train_loop: syntax:broken", 3, ["syntax.py:2", "SyntaxError"]),
    ("train_loop: u:loop_two_args", 3,
     ["cannot be called as u:loop_two_args(model, optimizer, micro_batches, run)",
      "u.py:21"]),
    ("optimizer: u:opt_empty\ntrain_loop: u:loop_dtype", 3,
     ["the optimizer factory 'u:opt_empty' returned []"]),
    ("optimizer: u:opt_other\ntrain_loop: u:loop_dtype", 3,
     ["over 2 parameter tensor(s) that are not the model's"]),
    ("device: cuda:7\ntrain_loop: u:loop_dtype", 2, ["spec.yaml:7: spec key 'device'"]),
    ("train_loop: u:loop_dtype", 3,
     ["changed torch's default dtype from torch.float32 to torch.float64", "restored"]),
])
def test_user_mistakes_are_named_where_they_are(tmp_path, extra, code, fragments):
    (tmp_path / "u.py").write_text(UNCLEAR)
    (tmp_path / "syntax.py").write_text("x = 1\ndef broken(:\n    pass\n")
    path = tmp_path / "spec.yaml"
    path.write_text("project_root: .\nmodel: u:make\ndata: u:data\naccumulation_steps: 2\n"
                    f"micro_batch_size: 4\noptimizer_steps: 2\n{extra}\n")
    result = run_cli("diagnose", path, "--out", tmp_path / "runs")
    assert result.returncode == code, result.stderr
    shown = " ".join(result.stderr.split())
    saved = list((tmp_path / "runs").glob("*.json"))
    error = json.loads(saved[0].read_text())["error"] if saved else {}
    where = (f"{Path(error['location']['file']).name}:{error['location']['line']}"
             if error.get("location") else "")
    for fragment in fragments:
        assert fragment in shown or fragment == where, (fragment, shown, where)
    assert "Traceback" not in result.stderr


def test_the_default_dtype_is_restored_after_a_loop_changed_it(tmp_path):
    import torch

    from ampdoctor.core.errors import UserCodeError
    from ampdoctor.runner import run_diagnose
    from ampdoctor.spec import load_spec

    (tmp_path / "u.py").write_text(UNCLEAR)
    path = tmp_path / "spec.yaml"
    path.write_text("project_root: .\nmodel: u:make\ndata: u:data\naccumulation_steps: 2\n"
                    "micro_batch_size: 4\noptimizer_steps: 2\ntrain_loop: u:loop_dtype\n"
                    "device: cpu\n")
    with pytest.raises(UserCodeError):
        run_diagnose(load_spec(path))
    assert torch.get_default_dtype() == torch.float32


# ------------------------------------------------------------ in a real headless browser
def _chromium() -> str | None:
    import shutil
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium on this machine "
                    "(.ci/run installs Debian's chromium)")
def test_the_postmortem_runs_no_script_and_loads_nothing_in_a_browser(tmp_path):
    import http.server
    import subprocess
    import threading

    requests: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's name for it
            requests.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{server.server_address[1]}"
    # a control page with the same payloads unescaped: proves the browser would run and fetch
    pwn = "document.body.setAttribute('data-pwned','1')"
    payloads = [f"<script>{pwn}</script>", f'"><img src="{origin}/img" onerror="{pwn}">',
                f"<script src={origin}/x.js></script>",
                f"<style>body{{background:url({origin}/css)}}</style>",
                f'<svg onload="{pwn}"></svg>', f"<iframe src={origin}/frame></iframe>"]
    try:
        control = tmp_path / "control.html"
        control.write_text("<html><body>" + "".join(payloads) + "</body></html>")
        pages = []
        for i, text in enumerate(payloads):
            page = tmp_path / f"p{i}.html"
            page.write_text(render_html(_hostile_record(text)))
            pages.append(page)

        def dom(page: Path) -> str:
            return subprocess.run(
                [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                 "--virtual-time-budget=2000", "--dump-dom", page.as_uri()],
                capture_output=True, text=True, timeout=60).stdout

        assert 'data-pwned="1"' in dom(control) and requests   # the payloads are live
        requests.clear()
        for page in pages:
            shown = dom(page)
            assert "<h1>" in shown and 'data-pwned="1"' not in shown, page
        assert requests == []
    finally:
        server.shutdown()
