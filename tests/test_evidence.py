"""`Evidence`, the typed dict of a finding's numbers: mypy checks the keys every rule writes
(`python -m mypy` fails on a key it does not list); here, the keys of real records are keys it
lists, and at run time it is the plain dict the record has always held."""

from __future__ import annotations

import json
from pathlib import Path

from ampdoctor.core.evidence import Evidence
from ampdoctor.kinds.base import Observed
from ampdoctor.kinds.loop_error import loop_error

GOLDEN = Path(__file__).resolve().parent / "golden"


def test_the_keys_of_recorded_findings_are_evidence_keys():
    keys = set(Evidence.__annotations__)
    seen = set()
    for path in sorted(GOLDEN.glob("*.record.json")):
        for finding in json.loads(path.read_text())["findings"]:
            seen |= set(finding["evidence"])
    assert seen, "no finding with evidence among the golden records"
    assert seen <= keys, sorted(seen - keys)
    assert {"measured", "expected"} <= seen


def test_evidence_is_a_plain_dict_in_the_record():
    evidence: Evidence = {"measured": 4.0, "expected": 1.0, "step": 0}
    finding = loop_error(Observed("fp32-accum", "error", "boom", evidence=evidence))
    assert type(finding.evidence) is dict
    assert (json.dumps(finding.to_dict()["evidence"])
            == '{"measured": 4.0, "expected": 1.0, "step": 0}')
    assert Evidence.__total__ is False
