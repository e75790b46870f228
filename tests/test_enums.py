"""The string enums of the record (`ampdoctor.core.enums`): they list exactly the kinds, rung ids,
statuses and severities the user-facing docs state (kinds and rungs in the docs' order), and a
member reads, compares, hashes, formats and serialises exactly as its plain string."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ampdoctor.core.enums import KindId, RungId, Severity, Status, StrEnum
from ampdoctor.core.findings import (
    RUNG_IDS,
    RUNG_STATUSES,
    Finding,
    RungResult,
    conclude,
)
from ampdoctor.kinds import CATALOGUE, KINDS, RULES

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _values(enum: type[StrEnum]) -> list[str]:
    return [member.value for member in enum]


def test_kind_ids_are_the_documented_kinds_in_order():
    documented = re.findall(r"^\| \[`([a-z0-9-]+)`\]\(#[a-z0-9-]+\) \|",
                            (DOCS / "kinds.md").read_text(), re.MULTILINE)
    assert len(documented) == 21
    assert _values(KindId) == documented
    # the catalogue and the rule table hold every id and nothing else, the catalogue in order
    assert [k.name for k in KINDS] == list(KindId)
    assert set(CATALOGUE) == set(RULES) == set(KindId)
    assert all(isinstance(k.name, KindId) and isinstance(r.kind, KindId)
               for k, r in zip(KINDS, RULES.values(), strict=True))


def test_rung_ids_are_the_documented_rungs_in_ladder_order():
    headings = re.findall(r"^## `([a-z0-9-]+)`\s*$", (DOCS / "rungs.md").read_text(),
                          re.MULTILINE)
    assert _values(RungId) == headings
    assert tuple(RungId) == RUNG_IDS


def test_statuses_and_severities_are_the_documented_ones():
    rungs = (DOCS / "rungs.md").read_text()
    table = rungs[:rungs.index("\n## ")]        # the status table precedes the first rung
    documented = re.findall(r"^\| `([a-z-]+)` \|", table, re.MULTILINE)
    assert len(documented) == 5 and sorted(_values(Status)) == sorted(documented)
    assert tuple(Status) == RUNG_STATUSES
    row = next(line for line in (DOCS / "record.md").read_text().splitlines()
               if line.startswith("| `severity` |"))
    assert _values(Severity) == re.findall(r"`([a-z]+)` \(its rung", row)


@pytest.mark.parametrize("member", [KindId.CLIP_BEFORE_UNSCALE, RungId.FP16_SCALER,
                                    Severity.WARNING, Status.NOT_RUN])
def test_a_member_is_its_string(member):
    value = member.value
    assert type(value) is str and member == value and value == member
    assert hash(member) == hash(value) and {value: 1}[member] == 1
    assert str(member) == value and f"{member}" == value
    assert "%s" % member == value    # noqa: UP031 - old-style formatting gives the value too
    assert f"{member:>30}|" == f"{value:>30}|" and format(member, "<20") == format(value, "<20")
    assert json.dumps({member: [member]}) == json.dumps({value: [value]})
    assert type(member)(value) is member


def test_records_hold_plain_strings_and_read_back_as_members():
    finding = Finding("fp16-scaler", "clip-before-unscale", "warning", "clipped while scaled")
    assert finding.kind is KindId.CLIP_BEFORE_UNSCALE and finding.severity is Severity.WARNING
    data = finding.to_dict()
    assert type(data["kind"]) is str and type(data["severity"]) is str
    assert (data["kind"], data["severity"]) == ("clip-before-unscale", "warning")
    result = conclude(RungId.FP16_SCALER, [finding], "ok")
    assert result.status is Status.WARN and result.id is RungId.FP16_SCALER
    assert result.to_dict()["status"] == "warn" and type(result.to_dict()["status"]) is str
    assert type(result.to_dict()["id"]) is str
    assert RungResult("skips", "skip").status is Status.SKIP


def test_an_unknown_value_is_refused():
    with pytest.raises(ValueError, match="unknown finding kind 'clip-after-unscale'"):
        Finding("fp16-scaler", "clip-after-unscale", "error", "?")
    with pytest.raises(ValueError, match="unknown severity 'fatal'"):
        Finding("fp16-scaler", "loop-error", "fatal", "?")
    with pytest.raises(ValueError):
        RungResult("fp8-scaler", "pass")
    with pytest.raises(ValueError):
        RungResult("skips", "passed")
