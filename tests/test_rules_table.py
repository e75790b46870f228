"""The rule table: every kind names where it is decided, and that file really decides it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ampdoctor.findings import CATALOGUE, RULES

PACKAGE = Path(__file__).resolve().parents[1] / "ampdoctor"


def test_every_kind_has_one_rule():
    assert set(RULES) == set(CATALOGUE)


@pytest.mark.parametrize("kind", sorted(RULES))
def test_the_named_file_raises_the_kind(kind):
    rule = RULES[kind]
    places = [part.strip() for part in rule.decided_in.split(";")]
    found = False
    for place in places:
        path, *functions = place.split(" ", 1)
        text = (PACKAGE / path).read_text()
        for name in (functions[0].split(",") if functions else []):
            assert re.search(rf"def {re.escape(name.strip())}\b", text), (kind, place, name)
        found = found or f'"{kind}"' in text
    assert found, f"{kind} is not raised in {rule.decided_in}"
