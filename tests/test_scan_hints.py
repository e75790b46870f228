"""The static hints of `ampdoctor scan`: clipping before `unscale_`, a scheduler or `zero_grad`
on every micro-batch of an accumulation window, a backward loss never divided by K. Each is a
warning with the file and line, in text, JSON and SARIF; none fires on a healthy recipe or on
the healthy shapes of popular scripts; none changes the exit code unless `--strict`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampdoctor.scan import scan_paths
from ampdoctor.scan.command import run_scan
from conftest import RECIPES, ROOT, run_cli

HEALTHY = sorted(RECIPES.glob("healthy_*.py"))

#: broken recipe -> the kind of the one hint it must give, at its `# BUG` line
BROKEN = {
    "broken_clip_before_unscale.py": "clip-before-unscale",
    "broken_clip_with_total_norm_before_unscale.py": "clip-before-unscale",
    "broken_fairseq_default_scale_clip.py": "clip-before-unscale",
    "broken_fetch_ahead_clip_before_unscale.py": "clip-before-unscale",
    "broken_scheduler_per_microbatch.py": "scheduler-per-microbatch",
    "broken_fetch_ahead_scheduler_per_microbatch.py": "scheduler-per-microbatch",
    "broken_missing_average.py": "missing-accumulation-average",
    "broken_fetch_ahead_missing_average.py": "missing-accumulation-average",
    "broken_zero_grad_inside.py": "zero-grad-inside-accumulation",
    "broken_fetch_ahead_zero_grad_inside.py": "zero-grad-inside-accumulation",
}


def bug_line(path: Path) -> int:
    hits = [i for i, text in enumerate(path.read_text().splitlines(), 1) if "# BUG" in text]
    assert len(hits) == 1, (path, hits)
    return hits[0]


def hints_of(path: Path) -> list[tuple[str, int]]:
    report = scan_paths([path])
    assert all(h.severity == "warning" and h.location is not None for h in report.hints)
    assert all(h.location.file == str(path) for h in report.hints)  # type: ignore[union-attr]
    return [(h.kind, h.location.line) for h in report.hints]  # type: ignore[union-attr]


def write(tmp_path: Path, code: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


def line_with(path: Path, text: str) -> int:
    hits = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


# -- negative controls: the healthy recipes -----------------------------------------------------

def test_there_are_healthy_recipes_to_check():
    assert len(HEALTHY) >= 25


@pytest.mark.parametrize("recipe", HEALTHY, ids=lambda p: p.name)
def test_no_hint_on_a_healthy_recipe(recipe):
    assert hints_of(recipe) == []


def test_no_hint_over_all_healthy_recipes_at_once():
    report = scan_paths(HEALTHY)
    assert report.files_scanned == len(HEALTHY)
    assert report.hints == [], [(h.kind, h.location) for h in report.hints]


# -- each hint on its broken recipe, at the line of the bug --------------------------------------

@pytest.mark.parametrize("recipe,kind", sorted(BROKEN.items()))
def test_hint_fires_on_its_broken_recipe_at_the_bug_line(recipe, kind):
    path = RECIPES / recipe
    assert hints_of(path) == [(kind, bug_line(path))]


def test_every_hint_kind_has_a_broken_recipe():
    from ampdoctor.scan.hints import HINT_KINDS
    assert set(BROKEN.values()) == set(HINT_KINDS)


def test_other_broken_recipes_give_no_hint_of_a_kind_they_do_not_have():
    """A hint names what the recipe's bug is, or says nothing: a recipe whose bug is of another
    kind (off by one, double average, reduction sum, ...) gets no hint at all."""
    for path in sorted(RECIPES.glob("broken_*.py")):
        if path.name in BROKEN:
            continue
        # a recipe made for another rung may carry a hint's bug too: then the hint is at its
        # `# BUG: <kind>` line (broken_missing_average_token_clip: no / K, as the scan says)
        marked = {(kind, n) for n, line in enumerate(path.read_text().splitlines(), start=1)
                  for kind in re.findall(r"# BUG: ([a-z-]+)", line)}
        assert [h for h in hints_of(path) if h not in marked] == [], path.name


# -- the shapes popular scripts write --------------------------------------------------------------

AMP_DOCS_ACCUMULATION = """\
    import torch
    from torch.amp import GradScaler, autocast

    scaler = GradScaler()
    for epoch in epochs:
        for i, (input, target) in enumerate(data):
            with autocast(device_type="cuda", dtype=torch.float16):
                output = model(input)
                loss = loss_fn(output, target)
                loss = loss / iters_to_accumulate
            scaler.scale(loss).backward()
            if (i + 1) % iters_to_accumulate == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        scheduler.step()
    """

HF_NO_TRAINER = """\
    from accelerate import Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
    """

HF_OLD_NO_TRAINER = """\
    def train(model, optimizer, lr_scheduler, train_dataloader, accelerator, args):
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / args.gradient_accumulation_steps
            accelerator.backward(loss)
            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
    """

ZERO_AT_WINDOW_START = """\
    def train(model, optimizer, scaler, loader, K):
        for i, (x, y) in enumerate(loader):
            if i % K == 0:
                optimizer.zero_grad(set_to_none=True)
            scaler.scale(model(x, y) / K).backward()
            if (i + 1) % K:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
    """

CLIP_IN_THE_OTHER_ARM = """\
    import torch
    def train(model, optimizer, scaler, loader, K, use_fp16):
        for i, (x, y) in enumerate(loader):
            loss = model(x, y) / K
            if use_fp16:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % K == 0:
                if not use_fp16:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                else:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(optimizer)
                    scaler.update()
                optimizer.zero_grad()
    """

NO_ACCUMULATION = """\
    import torch
    def train(model, optimizer, scheduler, scaler, loader):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
    """

LOSS_FROM_A_HELPER_THAT_DIVIDES = """\
    def compute_loss(model, batch, accumulation):
        return model(**batch).loss / accumulation

    def other_loss(model, batch):
        loss = model(**batch).loss
        loss /= 4
        return loss

    def train(model, optimizer, loader, K):
        for i, batch in enumerate(loader):
            compute_loss(model, batch, K).backward()
            loss = other_loss(model, batch)
            loss.backward()
            if (i + 1) % K == 0:
                optimizer.step()
                optimizer.zero_grad()
    """


@pytest.mark.parametrize("code", [AMP_DOCS_ACCUMULATION, HF_NO_TRAINER, HF_OLD_NO_TRAINER,
                                  ZERO_AT_WINDOW_START, CLIP_IN_THE_OTHER_ARM, NO_ACCUMULATION,
                                  LOSS_FROM_A_HELPER_THAT_DIVIDES],
                         ids=["amp-docs", "hf-no-trainer", "hf-old-no-trainer",
                              "zero-at-window-start", "clip-in-other-arm", "no-accumulation",
                              "helper-divides"])
def test_no_hint_on_healthy_shapes_of_popular_scripts(tmp_path, code):
    assert hints_of(write(tmp_path, code)) == []


# -- positives the recipes do not show ----------------------------------------------------------

def test_imported_clip_and_an_hf_loss_at_module_level(tmp_path):
    """A script with its loop at the top level: `from torch.nn.utils import clip_grad_norm_`,
    the loss from `outputs.loss` (never divided), a scheduler next to the backward."""
    path = write(tmp_path, """\
        import torch
        from torch.nn.utils import clip_grad_norm_ as clip

        scaler = torch.amp.GradScaler("cuda")
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
        for step, batch in enumerate(loader):
            outputs = model(**batch)
            loss = outputs.loss
            scaler.scale(loss).backward()  # missing
            sched.step()  # scheduler
            if (step + 1) % ACCUM == 0:
                clip(model.parameters(), 1.0)  # clip
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        """)
    assert hints_of(path) == [
        ("missing-accumulation-average", line_with(path, "# missing")),
        ("scheduler-per-microbatch", line_with(path, "# scheduler")),
        ("clip-before-unscale", line_with(path, "# clip")),
    ]


def test_a_boundary_flag_and_a_zero_grad_before_the_continue(tmp_path):
    path = write(tmp_path, """\
        def train(model, opt, loader, K):
            for i, (x, y) in enumerate(loader):
                last = (i + 1) % K == 0
                opt.zero_grad()  # zero
                (model(x, y) / K).backward()
                if not last:
                    continue
                opt.step()
        """)
    assert hints_of(path) == [("zero-grad-inside-accumulation", line_with(path, "# zero"))]


def test_a_constant_lambda_is_exempt_but_a_decaying_one_is_not(tmp_path):
    code = """\
        import torch
        def train(model, optimizer, loader, K):
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, FACTOR)
            for i, (x, y) in enumerate(loader):
                (model(x, y) / K).backward()
                scheduler.step()  # scheduler
                if (i + 1) % K == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        """
    constant = write(tmp_path, code.replace("FACTOR", "lambda s: 1.0"), "constant.py")
    assert hints_of(constant) == []
    decaying = write(tmp_path, code.replace("FACTOR", "lambda s: 0.9 ** s"), "decaying.py")
    assert hints_of(decaying) == [("scheduler-per-microbatch", line_with(decaying, "# sched"))]


def test_a_scaled_threshold_is_exempt_and_a_plain_one_is_not(tmp_path):
    code = """\
        import torch
        def train(model, optimizer, scaler, loader, K, max_norm):
            for i, (x, y) in enumerate(loader):
                scaler.scale(model(x, y) / K).backward()
                if (i + 1) % K == 0:
                    torch.nn.utils.clip_grad_value_(model.parameters(), THRESHOLD)  # clip
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
        """
    scaled = write(tmp_path, code.replace("THRESHOLD", "max_norm * scaler.get_scale()"), "s.py")
    assert hints_of(scaled) == []
    plain = write(tmp_path, code.replace("THRESHOLD", "max_norm"), "p.py")
    assert hints_of(plain) == [("clip-before-unscale", line_with(plain, "# clip"))]


def test_a_framework_clip_is_not_torch_clip(tmp_path):
    """`accelerator.clip_grad_norm_` unscales first: not a hint."""
    path = write(tmp_path, """\
        def train(model, optimizer, scaler, loader, accelerator):
            for x, y in loader:
                scaler.scale(model(x, y)).backward()
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
        """)
    assert hints_of(path) == []


# -- the outputs ---------------------------------------------------------------------------------

def test_text_json_and_sarif_carry_the_hint_with_file_and_line(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = RECIPES / "broken_scheduler_per_microbatch.py"
    line = bug_line(path)
    rel = "recipes/broken_scheduler_per_microbatch.py"

    assert run_scan([str(path)]) == 0
    text = capsys.readouterr().out
    assert f"WARNING (hint) scheduler-per-microbatch at {rel}:{line}" in text
    assert "1 static hint(s)" in text

    assert run_scan([str(path)], as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["findings"] == [] and data["exit_code"] == 0
    [hint] = data["hints"]
    assert hint["kind"] == "scheduler-per-microbatch" and hint["severity"] == "warning"
    assert hint["location"]["file"] == str(path) and hint["location"]["line"] == line
    assert hint["location"]["function"] == "train_loop"
    assert hint["rung"] == "scan" and hint["evidence"]["static"] is True

    assert run_scan([str(path)], fmt="sarif") == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    rules = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert rules == ["double-scaling", "scheduler-per-microbatch"]
    [result] = run["results"]
    assert result["ruleId"] == "scheduler-per-microbatch" and result["level"] == "warning"
    assert rules[result["ruleIndex"]] == "scheduler-per-microbatch"
    physical = result["locations"][0]["physicalLocation"]
    assert physical["artifactLocation"]["uri"] == rel
    assert physical["region"]["startLine"] == line


def test_hints_change_the_exit_code_only_under_strict(tmp_path):
    path = RECIPES / "broken_zero_grad_inside.py"
    plain = run_cli("scan", str(path), "--json")
    assert plain.returncode == 0, plain.stderr
    assert [h["kind"] for h in plain.record["hints"]] == ["zero-grad-inside-accumulation"]
    strict = run_cli("scan", str(path), "--strict")
    assert strict.returncode == 1, strict.stdout
    assert "failing under --strict" in strict.stdout and "(exit 1)" in strict.stdout
    healthy = run_cli("scan", str(RECIPES / "healthy_sgd.py"), "--strict")
    assert healthy.returncode == 0, healthy.stdout


def test_the_hints_never_import_torch():
    code = (
        "import sys\n"
        "from ampdoctor.scan import scan_paths\n"
        f"report = scan_paths([{str(RECIPES)!r}])\n"
        "assert report.hints, 'no hints over the recipes'\n"
        "assert 'torch' not in sys.modules, 'the hints imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
