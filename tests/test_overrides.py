"""A value given on the command line or through the API is named as such in messages, never
at the spec's line as if the file said it."""

from __future__ import annotations

import re

import pytest

from ampdoctor import api
from ampdoctor.core.errors import SpecError
from conftest import CONFIGS, run_cli

SPEC = CONFIGS / "healthy_sgd.yaml"


def _line(key: str) -> int:
    return next(n for n, line in enumerate(SPEC.read_text().splitlines(), 1)
                if line.startswith(f"{key}:"))


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_an_invalid_override_names_its_flag_not_the_file():
    result = run_cli("diagnose", SPEC, "--steps", "0")
    assert result.returncode == 2
    err = _flat(result.stderr)
    assert "--steps: spec key 'optimizer_steps'" in err
    assert "healthy_sgd.yaml" not in err          # the file never said 0


def test_an_overridden_device_is_named_with_its_flag(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SpecError) as exc:
        from ampdoctor.loading.loop import resolve_device
        resolve_device("cuda", api.load(SPEC, device="cuda", origins={"device": "--device"}))
    text = str(exc.value)
    assert text.startswith("device = 'cuda' (from --device): spec key 'device'")
    assert f"healthy_sgd.yaml:{_line('device')}" not in text


def test_a_message_at_the_files_line_says_which_overrides_were_in_effect():
    result = run_cli("diagnose", SPEC, "--steps", "500")
    assert result.returncode == 2
    err = _flat(result.stderr)
    # the slice is too small because of --steps: the line is the file's micro_batch_size, and
    # the message says the step count came from the command line
    assert (f"healthy_sgd.yaml:{_line('micro_batch_size')}, with optimizer_steps = 500 "
            "(from --steps): spec key 'micro_batch_size'") in err


def test_an_api_override_is_named_by_its_keyword():
    with pytest.raises(SpecError, match=r"^steps=: spec key 'optimizer_steps'"):
        api.load(SPEC, steps=0)
    spec = api.load(SPEC, steps=5)
    assert spec.origin("optimizer_steps") == "steps="
    assert spec.overridden() == "optimizer_steps = 5 (from steps=)"
    assert spec.origin("device") is None
    # the child process gets the spec through to_wire: the origins travel with it
    from ampdoctor.spec import from_wire, to_wire
    assert from_wire(to_wire(spec)).overridden() == "optimizer_steps = 5 (from steps=)"
