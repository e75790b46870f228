"""The reference under docs/ stays true to the code: every kind, spec key, rung and record key is
documented, every example parses, every relative link points at a file, and `explain` shows the
catalogue's example and fix."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ampdoctor import spec as spec_module
from ampdoctor.cli import app
from ampdoctor.core.findings import RUNG_IDS
from ampdoctor.kinds import CATALOGUE, RULES
from ampdoctor.record.model import RecordModel, validate
from ampdoctor.spec import Spec

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = ("README.md", "spec.md", "rungs.md", "kinds.md", "record.md", "exit-codes.md")
FORBIDDEN = ("../shared", "CONTRACT", "article §", "DESIGN §")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _blocks(text: str, lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(text) if tag == lang]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links in code are not links)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _prose(path.read_text(encoding="utf-8"))
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*)$", text, re.MULTILINE)}


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))


# --- the pages exist and are indexed -------------------------------------------------------

@pytest.mark.parametrize("page", PAGES)
def test_reference_page_exists(page):
    assert (DOCS / page).is_file(), f"docs/{page} is missing"


def test_docs_index_links_every_page():
    index = _read("README.md")
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"


# --- kinds ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(CATALOGUE))
def test_every_kind_has_an_example_and_a_fix(kind):
    entry = CATALOGUE[kind]
    assert entry.example.strip(), f"{kind}: empty example"
    assert entry.fix.strip(), f"{kind}: empty fix"
    assert entry.title.strip() and entry.why.strip()
    # an example is code: several lines, each short enough for a terminal
    assert "\n" in entry.example, f"{kind}: the example is a single line"
    assert all(len(line) <= 80 for line in entry.example.splitlines()), kind


def _kind_sections() -> dict[str, str]:
    text = _read("kinds.md")
    parts = re.split(r"^## `([a-z0-9-]+)`\s*$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_kinds_page_has_exactly_the_catalogue():
    assert set(_kind_sections()) == set(CATALOGUE)
    assert list(_kind_sections()) == list(CATALOGUE), "kinds.md follows the catalogue's order"


@pytest.mark.parametrize("kind", sorted(CATALOGUE))
def test_kind_section_has_bug_fix_and_reproduction(kind):
    section = _kind_sections()[kind]
    code = _blocks(section, "python")
    assert len(code) >= 2, f"{kind}: a bug example and a fix, both as code"
    targets = LINK.findall(_prose(section))
    assert any(t.startswith("../recipes/") and t.endswith(".py") for t in targets), kind
    assert any(t.startswith("../sample_configs/") and t.endswith(".yaml") for t in targets), kind
    for rung in re.findall(r"\*\*Rung\*\*: (.*)", section)[0].split(","):
        ids = re.findall(r"`([a-z0-9-]+)`", rung)
        assert all(i in RUNG_IDS for i in ids), (kind, ids)


def test_kinds_page_names_the_rungs_of_the_rule_table():
    """Each kind's 'decided in' rung column names real rungs."""
    rows = re.findall(r"^\| \[`([a-z0-9-]+)`\]\(#[a-z0-9-]+\) \| ([^|]+) \|", _read("kinds.md"),
                      re.MULTILINE)
    assert {k for k, _ in rows} == set(RULES)
    for kind, rungs in rows:
        named = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)+|reproducibility|skips", rungs)
        assert named or rungs.strip() == "any rung", kind
        assert all(w in RUNG_IDS for w in named), (kind, named)


# --- the spec ------------------------------------------------------------------------------

def _nested_models() -> dict[str, type]:
    return {"tolerances": spec_module.Tolerance, "scan": spec_module.ScanSettings,
            "ddp": spec_module.DDPSettings, "optimizer": spec_module.OptimizerMapping}


def _spec_keys() -> list[str]:
    return [k for k, f in Spec.model_fields.items() if not f.exclude]


@pytest.mark.parametrize("key", _spec_keys())
def test_every_spec_key_is_documented_with_an_example(key):
    text = _read("spec.md")
    sections = re.split(r"^### ", text, flags=re.MULTILINE)
    section = next((s for s in sections if s.startswith(f"`{key}`")), None)
    assert section is not None, f"docs/spec.md has no '### `{key}`' section"
    assert f"| `{key}` |" in text, f"{key} is missing from the keys table"
    examples = _blocks(section, "yaml")
    assert any(re.search(rf"^{re.escape(key)}:", b, re.MULTILINE) for b in examples), \
        f"{key}: no YAML example setting it"


@pytest.mark.parametrize("parent,key", [(p, k) for p, model in _nested_models().items()
                                        for k in model.model_fields])
def test_every_nested_spec_key_is_documented(parent, key):
    text = _read("spec.md")
    assert f"`{key}`" in text or f"{key}:" in text, f"{parent}.{key} is not in docs/spec.md"


def test_tolerance_precisions_and_defaults_are_documented():
    from ampdoctor.maths.compare import DEFAULT_TOLERANCES
    for page in ("spec.md", "rungs.md"):
        text = _read(page)
        for precision, tol in DEFAULT_TOLERANCES.items():
            row = re.search(rf"^\s*\| `?{precision}`? \| ([^|]+) \| ([^|]+) \|", text,
                            re.MULTILINE)
            assert row, (page, precision)
            assert float(row.group(1)) == tol.rtol and float(row.group(2)) == tol.atol, \
                (page, precision, row.groups())


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_spec_defaults_in_the_table_match_the_model():
    text = _read("spec.md")
    keys_table = text.split("### ")[0]
    for key in ("optimizer_steps", "device", "seed", "dropout", "timeout_s"):
        default = Spec.model_fields[key].default
        row = re.search(rf"^\| `{key}` \| [^|]+ \| ([^|]+) \|", keys_table, re.MULTILINE)
        assert row, key
        assert _shown(default) in row.group(1), (key, default, row.group(1))
    ddp = re.split(r"^### ", text, flags=re.MULTILINE)
    ddp = next(s for s in ddp if s.startswith("`ddp`"))
    for key, field in spec_module.DDPSettings.model_fields.items():
        row = re.search(rf"^\| `{key}` \| [^|]+ \| ([^|]+) \|", ddp, re.MULTILINE)
        assert row and _shown(field.default) in row.group(1), key


def test_run_attributes_are_documented():
    pytest.importorskip("torch")
    from ampdoctor.loading import RunSettings
    text = _read("spec.md")
    for field in dataclasses.fields(RunSettings):
        assert f"| `{field.name}` |" in text, f"run.{field.name} is not in docs/spec.md"
    assert "train_loop(model, optimizer, micro_batches, run)" in text


def test_slice_size_is_stated():
    text = _read("spec.md")
    assert "optimizer_steps × K × b" in text
    assert "3 × 4 × 8 = 96" in text


REQUIRED = {k for k, f in Spec.model_fields.items() if f.is_required()}
MINIMAL = {"model": "m:f", "data": "m:f", "train_loop": "m:f", "accumulation_steps": 2,
           "micro_batch_size": 1}


def test_yaml_examples_in_spec_page_are_valid_specs():
    """Every YAML block parses; one that names a train_loop is a complete spec, the others are
    fragments that must validate on top of a minimal spec (a misspelt key fails here)."""
    blocks = _blocks(_read("spec.md"), "yaml")
    assert len(blocks) >= len(_spec_keys())
    complete = 0
    for block in blocks:
        data = yaml.safe_load(block)
        assert isinstance(data, dict), block
        if set(data) >= REQUIRED:
            complete += 1
            Spec.model_validate(data)
        else:
            Spec.model_validate({**MINIMAL, **data})
    assert complete >= 2


# --- rungs ---------------------------------------------------------------------------------

def test_every_rung_is_documented_in_ladder_order():
    text = _read("rungs.md")
    headings = re.findall(r"^## `([a-z0-9-]+)`\s*$", text, re.MULTILINE)
    assert headings == list(RUNG_IDS)
    from ampdoctor.core.findings import RUNG_STATUSES
    for status in RUNG_STATUSES:
        assert f"| `{status}` |" in text, status


def test_rungs_page_states_the_thresholds():
    from ampdoctor.core import thresholds
    text = _read("rungs.md")
    assert f"{thresholds.SKIP_RATE_THRESHOLD:.0%}".replace("%", " %") in text
    assert f"above {thresholds.SCHEDULER_SKIP_RATE:.0%}".replace("%", " %") in text
    assert _number_in(thresholds.REPEAT_RTOL, text)
    assert _number_in(thresholds.REPEAT_ATOL, text)
    assert _number_in(thresholds.NOISE_MIN_COSINE, text)
    low, high = thresholds.NOISE_RATIO_BAND
    assert f"{low:g}–{high:g}" in text
    assert _number_in(thresholds.HYPOTHESIS_RTOL_FLOOR, text)
    assert _number_in(thresholds.FORCED_CLIP_FRACTION, text) or "a tenth" in text


def _number_in(value: float, text: str) -> bool:
    """`value` written in the text as 0.002, 2e-03 or 2e-3."""
    written = [f"{value:g}"] + [f"{value:.{p}e}" for p in range(3)]
    forms = {w for w in written if float(w) == value}
    forms |= {re.sub(r"e([+-])0(\d)", r"e\1\2", f) for f in forms}
    return any(re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", text) for f in forms)


# --- the record ----------------------------------------------------------------------------

def test_record_example_is_a_valid_record():
    blocks = _blocks(_read("record.md"), "json")
    assert blocks
    record = json.loads(blocks[0])
    validate(record, "docs/record.md")
    assert record["verdict"] == "failed" and record["findings"]


def test_every_record_key_is_documented():
    text = _read("record.md")
    for key in RecordModel.model_fields:
        assert f"`{key}`" in text, key
    from ampdoctor.record.model import FindingModel, LocationModel, RungModel
    for model in (FindingModel, LocationModel, RungModel):
        for key in model.model_fields:
            assert f"`{key}`" in text, (model.__name__, key)
    example = json.loads(_blocks(text, "json")[0])
    for key in example:
        assert f"| `{key}` |" in text, f"top-level key {key} is not in the table"


# --- exit codes ----------------------------------------------------------------------------

def test_exit_codes_cover_every_command():
    text = _read("exit-codes.md")
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        assert f"ampdoctor {name}" in text, name
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 4 |", "130", "143"):
        assert code in text, code


def test_readme_exit_codes_hold_every_outcome_of_the_contract():
    # the README's table left out inconclusive (exit 2) and the signals; its API example
    # promised verdicts "healthy" | "failed" | "error" and exit codes 0, 1 or 3
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### 3. Exit codes")[1].split("\n\n")[1]
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 4 |", "| 128 + N |", "inconclusive"):
        assert code in table, code
    assert '"healthy" | "failed" | "inconclusive" | "error"' in readme
    assert "0, 1, 2 or 3" in readme


def test_exit_code_example_handles_a_bad_spec_that_wrote_no_record():
    # a bad spec prints no record on stdout: `jq` on the empty file printed nothing at all
    script = _blocks(_read("exit-codes.md"), "bash")[0]
    assert "[ -s run.json ]" in script


# --- links and leaks -----------------------------------------------------------------------

def _relative_links() -> list[tuple[Path, str]]:
    found = []
    for path in _markdown_files():
        for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            found.append((path, target))
    return found


@pytest.mark.parametrize("path,target", _relative_links(),
                         ids=lambda v: v.name if isinstance(v, Path) else v)
def test_relative_links_point_at_files(path, target):
    file_part, _, fragment = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    assert dest.exists(), f"{path.relative_to(ROOT)} links {target}: no such file"
    assert ROOT in dest.parents or dest == ROOT, f"{target} leaves the repository"
    if fragment and dest.suffix == ".md" and DOCS in dest.parents:
        assert fragment in _anchors(dest), f"{path.relative_to(ROOT)}: no anchor #{fragment}"


def test_links_found():
    """The link check above really sees the docs' links."""
    targets = [t for p, t in _relative_links() if p.parent == DOCS]
    assert len(targets) > 50


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.name)
def test_docs_do_not_mention_internal_documents(path):
    text = path.read_text(encoding="utf-8")
    for word in FORBIDDEN:
        assert word not in text, f"{path.relative_to(ROOT)} mentions {word!r}"


# --- explain -------------------------------------------------------------------------------

def _squash(text: str) -> str:
    return " ".join(text.split())


def test_explain_shows_the_example_and_the_fix():
    entry = CATALOGUE["clip-before-unscale"]
    result = CliRunner().invoke(app, ["explain", "clip-before-unscale"],
                                env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Example" in out and "Fix" in out
    assert "scaler.unscale_(optimizer)" in out
    for line in entry.example.splitlines():
        assert line.rstrip() in out, line
    assert _squash(entry.fix) in _squash(out)


def test_explain_json_carries_the_example_and_the_fix():
    result = CliRunner().invoke(app, ["explain", "clip-before-unscale", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    entry = CATALOGUE["clip-before-unscale"]
    assert data["example"] == entry.example and data["fix"] == entry.fix
    assert "clip_grad_norm_" in data["example"]
