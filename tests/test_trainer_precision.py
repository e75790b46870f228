"""transformers' and accelerate's refusals of an HF Trainer whose precision disagrees with its
DeepSpeed config, read back into the two settings (rules.trainer_precision). The texts are the
ones transformers 5.25 and accelerate 1.16 raised on this machine (tests/test_hf_trainer_deep
speed.py runs them for real); an unrelated mismatch in the same list is not a precision."""

from __future__ import annotations

import pytest

from ampdoctor.kinds.double_scaling import Outcome
from ampdoctor.rules.trainer_precision import forced_refusal, refusal

TRANSFORMERS = ("Please correct the following DeepSpeed config values that mismatch "
                "TrainingArguments values:\n{lines}\nThe easiest method is to set these "
                "DeepSpeed config values to 'auto'.")
ACCELERATE = ("`--mixed_precision` arg cannot be set to `{asked}` when `{section}` is set in the "
              "DeepSpeed config file.")


@pytest.mark.parametrize(("text", "outcome", "asked", "section", "state"), [
    (TRANSFORMERS.format(lines="- ds bf16.enabled=False vs hf bf16|bf16_full_eval=True"),
     Outcome.REFUSED_BY_TRANSFORMERS, "bf16", "bf16", "off"),
    (TRANSFORMERS.format(lines="- ds fp16.enabled=True vs hf fp16|fp16_full_eval=False"),
     Outcome.REFUSED_BY_TRANSFORMERS, "fp32", "fp16", "on"),
    (TRANSFORMERS.format(lines="- ds gradient_accumulation_steps=2 vs hf "
                               "gradient_accumulation_steps=4\n- ds bf16.enabled=True vs hf "
                               "bf16|bf16_full_eval=False"),
     Outcome.REFUSED_BY_TRANSFORMERS, "fp32", "bf16", "on"),
    (ACCELERATE.format(asked="bf16", section="fp16"),
     Outcome.REFUSED_BY_ACCELERATE, "bf16", "fp16", "on"),
    (ACCELERATE.format(asked="fp16", section="bf16"),
     Outcome.REFUSED_BY_ACCELERATE, "fp16", "bf16", "on"),
])
def test_each_refusal_names_the_trainers_precision_and_the_config_key(text, outcome, asked,
                                                                       section, state):
    met = refusal(text)
    assert met is not None
    assert (met.outcome, met.asked, met.section, met.state) == (outcome, asked, section, state)
    assert met.config_key == f"{section}.enabled"
    assert f"`{section}.enabled`" in met.meaning()


@pytest.mark.parametrize("text", [
    TRANSFORMERS.format(lines="- ds gradient_accumulation_steps=2 vs hf "
                              "gradient_accumulation_steps=4"),
    "Type fp16 is not supported on your device.",    # the device, not a disagreement
    "CUDA out of memory",
])
def test_other_errors_are_not_a_precision_disagreement(text):
    assert refusal(text) is None


PINNED_BF16_AT_FP32 = TRANSFORMERS.format(lines="- ds bf16.enabled=True vs hf "
                                                "bf16|bf16_full_eval=False")
PINNED_BF16_AT_FP16 = ACCELERATE.format(asked="fp16", section="bf16")
BF16_OFF = TRANSFORMERS.format(lines="- ds bf16.enabled=False vs hf bf16|bf16_full_eval=True")


@pytest.mark.parametrize(("text", "rung", "own", "skipped"), [
    # the loop follows the rung's precision; the config pins the user's own bf16: the rung's
    # forcing caused the refusal (a skip, with the key to set to "auto")
    (PINNED_BF16_AT_FP32, "fp32", ["fp32", "bf16"], True),
    (PINNED_BF16_AT_FP16, "fp16", ["fp32", "bf16", "fp16"], True),
    # bf16 is not a precision the user trains in: their fp32 Trainer and config disagree
    (PINNED_BF16_AT_FP32, "fp32", ["fp32"], False),
    # the Trainer asks for fp32 at the bf16 rung: it ignores run.precision, the user's own clash
    (PINNED_BF16_AT_FP32, "bf16", ["fp32", "bf16"], False),
    # a config that switches the asked precision off is never ampdoctor's doing
    (BF16_OFF, "bf16", ["fp32", "bf16"], False),
    ("RuntimeError: something else", "fp32", ["fp32", "bf16"], False),
])
def test_a_refusal_only_the_rungs_forced_precision_caused_is_a_skip(text, rung, own, skipped):
    reason = forced_refusal(RuntimeError(text), text, rung, own)
    assert (reason is not None) == skipped
    if skipped:
        assert reason is not None and "`bf16.enabled`" in reason and '"auto"' in reason
