"""Hostile text: nothing the user controls reaches a terminal (or a page, or a SARIF viewer) raw.

A spec name, a file name, an exception message, a record re-rendered by `ampdoctor report` may
hold ESC sequences (CSI colours, OSC 0 window titles, OSC 8 hyperlinks), C1 controls, CR, NUL
and bidi overrides. Every rendering shows them as visible escapes (`\\x1b`, `\\u202e`) and keeps
ordinary non-ASCII text (é, 日本語, emoji) as it is; long user text is cut, with a note.
"""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from rich.console import Console

from ampdoctor.core import safetext
from ampdoctor.core.errors import ERROR_LIMIT, UserCodeError, format_traceback
from ampdoctor.core.safetext import (
    MESSAGE_LIMIT,
    TRACEBACK_LIMIT,
    cut,
    exc_text,
    inert,
    safe_repr,
    safe_str,
)
from ampdoctor.report.html import render_html
from ampdoctor.report.terminal import render
from conftest import run_cli
from test_hostile import _hostile_record

#: (name, hostile text, an escape that must be visible once the text is rendered)
HOSTILE = [
    ("csi-colour", "\x1b[31mRED\x1b[0m", "\\x1b[31m"),
    ("osc0-retitle", "\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),
    ("osc8-link", "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\",
     "\\x1b]8;;https://evil.example/"),
    ("c1-csi", "\x9b31mC1", "\\x9b31m"),
    ("cr-overwrite", "all good\rEVIL", "all good\\rEVIL"),
    ("nul", "a\x00b", "a\\x00b"),
    ("del-bel-bs", "x\x7fy\x07z\x08", "x\\x7fy\\x07z\\x08"),
    ("bidi-rlo", "abc\u202edef", "abc\\u202edef"),
    ("bidi-isolate", "abc\u2066def\u2069", "abc\\u2066def\\u2069"),
]
IDS = [name for name, _, _ in HOSTILE]

#: What must never appear raw in a rendering: C0 (but newline and tab), DEL, C1, bidi.
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
#: In a one-line context (a title, a SARIF uri) newline and tab are hostile too.
RAW_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")

ORDINARY = "café naïve — 日本語のテキスト 😀 👩‍👩‍👧 ✔︎ Ωμέγα"

BIG = 20_000_000


def _raw(text: str) -> list[str]:
    return sorted({f"U+{ord(c):04X}" for c in RAW.findall(text)})


# ------------------------------------------------------------------------- safetext itself
@pytest.mark.parametrize("name, text, visible", HOSTILE, ids=IDS)
def test_inert_makes_every_control_visible(name, text, visible):
    shown = inert(text)
    assert _raw(shown) == [], shown
    assert visible in shown
    assert inert(shown) == shown                    # idempotent
    assert safetext.is_inert(shown)


def test_inert_keeps_ordinary_text_and_newlines():
    assert inert(ORDINARY) == ORDINARY
    assert inert(ORDINARY, multiline=False) == ORDINARY
    assert inert("line 1\n\tline 2") == "line 1\n\tline 2"
    assert inert("line 1\n\tline 2", multiline=False) == "line 1\\n\\tline 2"
    assert inert("windows\r\nline") == "windows\nline"          # CR-LF is a newline
    assert inert("a\rb\r\n") == "a\\rb\n"                       # a lone CR is not
    assert inert("C:\\Users\\me") == "C:\\Users\\me"          # backslashes stay
    assert inert("\ud83d") == "\\ud83d"                        # a lone surrogate
    assert inert(None) == "None" and inert(42) == "42"


def test_cut_says_how_much_was_cut():
    assert cut("short", 10) == "short"
    text = cut("x" * BIG, MESSAGE_LIMIT)
    assert text.startswith("x" * MESSAGE_LIMIT)
    assert text.endswith(f"… [{BIG - MESSAGE_LIMIT:,} more characters cut]")
    assert len(text) < MESSAGE_LIMIT + 60
    both = cut("a" * 100 + "b" * 100, 40, tail=10)
    assert both == "a" * 30 + "… [160 characters cut] …" + "b" * 10
    assert inert("\x1b" * 100, limit=10).startswith("\\x1b" * 10 + "… [90 more")


class _RaisingStr(Exception):
    def __str__(self):
        raise ValueError("no str for you")


class _IntStr(Exception):
    def __str__(self):
        return 42


class _RaisingRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


def test_safe_str_never_raises():
    assert safe_str(_RaisingStr()) == "<_RaisingStr: str() raised ValueError>"
    assert safe_str(_IntStr()) == "<_IntStr: str() returned int, not a str>"
    assert exc_text(_RaisingStr()) == "_RaisingStr: <_RaisingStr: str() raised ValueError>"
    assert exc_text(KeyError("k")) == "KeyError: 'k'"
    assert exc_text(ValueError()) == "ValueError"
    assert safe_repr(_RaisingRepr()) == "<_RaisingRepr: repr() raised RuntimeError>"
    assert exc_text(ValueError("m" * BIG)).endswith("more characters cut]")


# ------------------------------------------------------------- user text entering a record
def test_a_20mb_message_is_cut_where_it_enters_the_record():
    huge = ValueError("\x1b]0;pwned\x07" + "M" * BIG)
    try:
        raise huge
    except ValueError as exc:
        tb = format_traceback(exc)
        error = UserCodeError(f"the loop raised: {exc}", cause=exc)
    assert len(tb) < TRACEBACK_LIMIT + 100
    assert "characters cut]" in tb and tb.startswith("Traceback (most recent call last)")
    assert len(error.message) < ERROR_LIMIT + 100
    assert error.message.endswith("more characters cut]")
    assert str(error) == error.message
    # the stored text is the truth, cut: renderers make it inert, not the record
    assert error.message.startswith("the loop raised: \x1b]0;pwned\x07MMM")


def test_an_exception_whose_str_raises_has_a_traceback_and_a_message():
    try:
        raise _RaisingStr()
    except _RaisingStr as exc:
        tb = format_traceback(exc)
        error = UserCodeError(exc_text(exc), cause=exc)
    assert "_RaisingStr" in tb
    assert error.message == "_RaisingStr: <_RaisingStr: str() raised ValueError>"


def test_loop_error_finding_survives_a_raising_str_and_a_huge_message():
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from ampdoctor.rules.loop_errors import loop_error_finding

    for exc, expect in ((_RaisingStr(), "<_RaisingStr: str() raised ValueError>"),
                        (ValueError("\x1b[2J" + "M" * BIG), "more characters cut]"),
                        (SystemExit(_RaisingRepr()), "repr() raised RuntimeError")):
        try:
            raise exc
        except BaseException as caught:   # noqa: BLE001
            error = caught
        trace = SimpleNamespace(error=error, precision="fp32", finder=None, error_site=None,
                                events=[], events_of=lambda cls: [],
                                settings=SimpleNamespace(max_grad_norm=None))
        finding = loop_error_finding(trace, "fp32-accum").to_dict()
        assert expect in finding["evidence"]["error"]
        assert len(json.dumps(finding)) < 2 * (MESSAGE_LIMIT + TRACEBACK_LIMIT)


# ------------------------------------------------------------------- terminal (report)
def _terminal(record: dict, width: int = 100, color: bool = False) -> str:
    buf = io.StringIO()
    console = (Console(file=buf, width=width, force_terminal=True, color_system="truecolor")
               if color else Console(file=buf, width=width, no_color=True, force_terminal=False))
    render(record, console)
    return buf.getvalue()


def _terminal_record(text: str) -> dict:
    record = _hostile_record(text)
    record["findings"][0].update(severity="error", kind="gradient-mismatch", rung="fp32-accum")
    record["rungs"][0]["status"] = "fail"
    return record


@pytest.mark.parametrize("name, text, visible", HOSTILE, ids=IDS)
def test_the_terminal_report_shows_every_field_inert(name, text, visible):
    shown = _terminal(_terminal_record(text))
    assert _raw(shown) == [], shown
    # the name, the device, a rung, the message, the fix, a note, the source lines...
    assert shown.count(visible) >= 6, shown


@pytest.mark.parametrize("name, text, visible", HOSTILE, ids=IDS)
def test_the_terminal_report_with_colour_has_only_richs_own_sequences(name, text, visible):
    shown = _terminal(_terminal_record(text), color=True)
    own = re.sub(r"\x1b\[[0-9;]*m", "", shown)           # rich's own SGR colours
    assert _raw(own) == [], own
    assert visible in own


@pytest.mark.parametrize("name, text, visible", HOSTILE, ids=IDS)
def test_ampdoctor_report_prints_a_hostile_record_inert(tmp_path, name, text, visible):
    record = _terminal_record(text)
    record["error"] = None
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    result = run_cli("report", path)
    assert result.returncode == 0, result.stderr
    assert _raw(result.stdout) == [], result.stdout
    assert visible in result.stdout


def test_the_terminal_report_of_an_error_record_is_inert(tmp_path):
    text = HOSTILE[1][1] + HOSTILE[7][1]
    record = _hostile_record(text)
    record["rungs"] = []
    record["error"].update(location={"file": f"/x/{text}.py", "line": 3},
                           source={"file": "x", "start": 2, "line": 3, "lines": [text, text]})
    shown = _terminal(record)
    assert _raw(shown) == []
    assert shown.count("\\x1b]0;pwned\\x07abc\\u202edef") >= 4


def test_ordinary_text_reaches_the_terminal_unchanged():
    shown = _terminal(_terminal_record(ORDINARY), width=200)
    assert shown.count(ORDINARY) >= 6
    assert "\\u" not in shown and "\\x" not in shown


def test_a_20mb_message_is_cut_in_the_terminal(tmp_path):
    record = _terminal_record("x")
    record["error"] = {"type": "UserCodeError", "exit_code": 3,
                       "message": "\x1b[2J" + "E" * BIG}
    record["findings"][0]["message"] = "F" * BIG
    record["findings"][0]["evidence"] = {"error": "V" * BIG}
    record["notes"] = ["N" * BIG]
    shown = _terminal(record, width=120)
    assert len(shown) < 200_000
    assert shown.count("more characters cut]") >= 3
    path = tmp_path / "big.json"                    # one 20 MB field: under the 64 MiB cap
    path.write_text(json.dumps(dict(_terminal_record("x"), notes=["\x1b]0;t\x07" + "N" * BIG])))
    result = run_cli("report", path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) < 1_000_000 and "more characters cut]" in result.stdout
    # (the 20 MB word is folded onto the lines after "note:", its escape shown)
    assert "note:" in result.stdout and "\\x1b]0;t\\x07NNN" in result.stdout
    assert _raw(result.stdout) == []
    record["rungs"] = []                                 # the error alone is shown
    shown = _terminal(record, width=120)
    assert len(shown) < 20_000 and "\\x1b[2J" in shown
    assert f"[{BIG + 4 - MESSAGE_LIMIT:,} more characters cut]" in shown


# ------------------------------------------------------------------------------ HTML page
@pytest.mark.parametrize("name, text, visible", HOSTILE, ids=IDS)
def test_the_postmortem_shows_every_field_inert(name, text, visible):
    page = render_html(_hostile_record(text))
    assert _raw(page) == []
    title = re.search(r"<title>(.*?)</title>", page, re.S).group(1)
    assert RAW_ONE_LINE.search(title) is None and "\n" not in title
    import html
    assert visible in html.unescape(title)
    assert html.unescape(page).count(visible) >= 10


def test_the_postmortem_keeps_ordinary_text_and_cuts_a_huge_one(tmp_path):
    page = render_html(_hostile_record(ORDINARY))
    assert page.count(ORDINARY) >= 10
    record = _hostile_record("x")
    record["error"]["message"] = "\x1b" + "E" * BIG
    record["error"]["traceback"] = "T" * BIG
    page = render_html(record)
    assert len(page) < 2_000_000 and page.count("more characters cut]") >= 2
    assert _raw(page) == [] and "\\x1bEEE" in page
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_hostile_record(HOSTILE[1][1])))
    result = run_cli("report", path, "--html", "-o", tmp_path / "r.html")
    assert result.returncode == 0, result.stderr
    written = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert _raw(written) == [] and "\\x1b]0;pwned\\x07" in written


# ---------------------------------------------------------------- scan: hostile file names
SRC = ('import torch\nscaler = torch.amp.GradScaler("cuda")\n'
       "def step(model, loss, opt):\n    scaler.scale(loss * 1024).backward()\n"
       "    scaler.step(opt)\n    scaler.update()\n")

#: file names cannot hold NUL or "/": the rest of the family, in one name each
FILE_NAMES = [(n, t.replace("/", "_"), v.replace("/", "_")) for n, t, v in HOSTILE if n != "nul"]


def _tree(tmp_path: Path, text: str) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / f"train {text} é#%?.py").write_text(SRC)
    return tree


@pytest.mark.parametrize("name, text, visible", FILE_NAMES, ids=[n for n, _, _ in FILE_NAMES])
def test_scan_text_output_shows_hostile_file_names_inert(tmp_path, name, text, visible):
    tree = _tree(tmp_path, text)
    result = run_cli("scan", tree, cwd=tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert _raw(result.stdout) == [], result.stdout
    assert result.stdout.count(visible) >= 3       # the owners, the finding, its message
    assert "é#%?.py" in result.stdout


@pytest.mark.parametrize("name, text, visible", FILE_NAMES, ids=[n for n, _, _ in FILE_NAMES])
def test_scan_json_keeps_paths_exact_and_text_inert(tmp_path, name, text, visible):
    tree = _tree(tmp_path, text)
    result = run_cli("scan", tree, "--json", cwd=tree)
    assert result.returncode == 1, result.stderr
    assert _raw(result.stdout) == [] and result.stdout.isascii()   # JSON-escaped
    report = json.loads(result.stdout)
    path = str(tree / f"train {text} é#%?.py")
    assert {o["file"] for o in report["owners"]} == {path}         # a tool can open it
    message = report["findings"][0]["message"]
    assert _raw(message) == [] and visible in message


@pytest.mark.parametrize("name, text, visible", FILE_NAMES, ids=[n for n, _, _ in FILE_NAMES])
def test_scan_sarif_uris_are_valid_and_messages_inert(tmp_path, name, text, visible):
    tree = _tree(tmp_path, text)
    result = run_cli("scan", tree, "--format", "sarif", cwd=tree)
    assert result.returncode == 1, result.stderr
    run = json.loads(result.stdout)["runs"][0]
    result0 = run["results"][0]
    assert _raw(result0["message"]["text"]) == [] and visible in result0["message"]["text"]
    locations = [result0["locations"][0]] + result0["relatedLocations"]
    for location in locations:
        artifact = location["physicalLocation"]["artifactLocation"]
        uri = artifact["uri"]
        assert RAW_ONE_LINE.search(uri) is None and uri.isascii()
        assert " " not in uri and "#" not in uri and "?" not in uri
        # RFC 3986 path characters only, every other byte percent-encoded
        assert re.fullmatch(r"(?:[A-Za-z0-9._~/-]|%[0-9A-F]{2})+", uri), uri
        parts = urlsplit(uri)
        assert (parts.scheme, parts.netloc, parts.query, parts.fragment) == ("", "", "", "")
        assert unquote(parts.path) == f"train {text} é#%?.py"
        assert artifact["uriBaseId"] == "%SRCROOT%"


def test_scan_sarif_absolute_uris_are_file_uris(tmp_path):
    tree = _tree(tmp_path, "\x1b[31m")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_cli("scan", tree, "--format", "sarif", cwd=elsewhere)
    assert result.returncode == 1, result.stderr
    run = json.loads(result.stdout)["runs"][0]
    uri = run["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    parts = urlsplit(uri)
    assert parts.scheme == "file" and " " not in uri and "#" not in uri and "?" not in uri
    assert unquote(parts.path) == str(tree / "train \x1b[31m é#%?.py")
    base = run["originalUriBaseIds"]["%SRCROOT%"]["uri"]
    assert urlsplit(base).scheme == "file"


@pytest.mark.skipif(sys.platform == "darwin", reason="APFS refuses names that are not UTF-8")
def test_scan_survives_a_file_name_that_is_not_utf8(tmp_path):
    import os
    tree = tmp_path / "tree"
    tree.mkdir()
    with open(os.path.join(os.fsencode(tree), b"bad\xff.py"), "wb") as fh:
        fh.write(SRC.encode())
    result = run_cli("scan", tree, cwd=tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "bad\\udcff.py:4" in result.stdout
    result = run_cli("scan", tree, "--format", "sarif", cwd=tree)
    run = json.loads(result.stdout)["runs"][0]
    assert run["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] \
        == "bad%FF.py"


def test_a_missing_hostile_path_is_one_inert_line(tmp_path):
    result = run_cli("scan", tmp_path / "nope\x1b]0;pwned\x07\u202e")
    assert result.returncode == 2
    assert _raw(result.stderr) == [] and "nope\\x1b]0;pwned\\x07\\u202e" in result.stderr
