"""A run stopped by transformers or accelerate refusing an HF Trainer whose precision disagrees
with the DeepSpeed config it hands over: the disagreement (`double-scaling`, as the static scan
names it, `scan.precision_agreement`), not the user's `loop-error`.

The two refusals, as transformers 5.25 and accelerate 1.16 word them (measured):

- accelerate, when the Trainer is built: "`--mixed_precision` arg cannot be set to `bf16` when
  `fp16` is set in the DeepSpeed config file." (the config enables the other half precision);
- transformers, when `train()` starts: "Please correct the following DeepSpeed config values
  that mismatch TrainingArguments values:\\n- ds bf16.enabled=False vs hf bf16|bf16_full_eval=
  True\\n..." (a section explicitly on, or off, against the Trainer's ask; other keys of the
  same list, such as `gradient_accumulation_steps`, are not precisions and not judged here).

No torch here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..core.findings import Finding, Location
from ..kinds.double_scaling import Outcome, PrecisionsDisagree, precisions_disagree
from ..scan.configs import text_locator

_ACCELERATE = re.compile(r"`--mixed_precision` arg cannot be set to `(fp16|bf16)` when "
                         r"`(fp16|bf16)` is set in the DeepSpeed config file")
_TRANSFORMERS = re.compile(r"- ds (fp16|bf16)\.enabled=(\S+) vs hf (?:fp16|bf16)\S*=(\S+)")


@dataclass(frozen=True)
class Refusal:
    """What a refusal says: the Trainer's precision, the config section and its state."""

    outcome: Outcome
    asked: str           # the Trainer's precision ("fp32", "bf16", "fp16")
    section: str         # the config's section ("fp16", "bf16")
    state: str           # "on" or "off"

    @property
    def config_key(self) -> str:
        return f"{self.section}.enabled"

    def meaning(self) -> str:
        """The refusal in the user's terms (for a message without the scan's owners)."""
        asked = "neither fp16 nor bf16" if self.asked == "fp32" else self.asked
        says = "enables" if self.state == "on" else "switches off"
        return (f"the Trainer's TrainingArguments ask for {asked} and the DeepSpeed config it "
                f"hands over {says} {self.section} (`{self.config_key}`): two settings own the "
                "precision of one engine and disagree (double-scaling). Set the config's "
                '"fp16"/"bf16" `enabled` to "auto" so the Trainer fills them in, or make both '
                "ask for the same precision")


def refusal(text: str) -> Refusal | None:
    """The precision disagreement an exception's text reports, or None."""
    match = _ACCELERATE.search(text)
    if match:
        return Refusal(Outcome.REFUSED_BY_ACCELERATE, match.group(1), match.group(2), "on")
    if "mismatch TrainingArguments" not in text:
        return None
    for section, ds_value, hf_value in _TRANSFORMERS.findall(text):
        on = ds_value.lower() == "true"
        if on and hf_value.lower() == "false":
            # the config enables a precision the Trainer does not ask for; which one it asks
            # for is the other refusal's (accelerate's): here it asks for neither
            return Refusal(Outcome.REFUSED_BY_TRANSFORMERS, "fp32", section, "on")
        if not on and hf_value.lower() == "true":
            return Refusal(Outcome.REFUSED_BY_TRANSFORMERS, section, section, "off")
    return None


def forced_refusal(error: BaseException | None, text: str, precision: str,
                   own: Collection[str]) -> str | None:
    """Why a rung cannot run, when transformers or accelerate refused its Trainer only because
    the rung forced a precision the DeepSpeed config pins another one for: the Trainer asked for
    the rung's own precision (the loop follows `run.precision`), the config enables a precision
    the user trains in (`own`, the spec's precisions) that is not the rung's. None otherwise: a
    Trainer that asks for another precision than the rung's, or a config that switches the asked
    one off, disagree in the user's own training (the double-scaling finding)."""
    met = refusal(text) if error is not None else None
    if (met is None or met.state != "on" or met.asked != precision
            or met.section == precision or met.section not in own):
        return None
    return (f"the DeepSpeed config pins {met.section} (`{met.config_key}`: true) and the loop's "
            f"Trainer follows the run's precision: the {precision} run was refused "
            f"({met.outcome.value}). Set `{met.config_key}` to \"auto\" to have every rung run")


def _arguments(exc: BaseException) -> Any:
    """The TrainingArguments of the Trainer the traceback went through (the probe marked where
    they were built), or None."""
    tb = exc.__traceback__
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        args = getattr(owner, "args", None)
        if getattr(args, "_ampdoctor_site", None) is not None:
            found = args
        tb = tb.tb_next
    return found


def finding_from_error(exc: BaseException, text: str, rung: str) -> Finding | None:
    """The `double-scaling` finding of a run that transformers or accelerate refused over the
    precision, at the TrainingArguments line with the config file's key beside it (the owners
    the scan names); None for any other error, or where the arguments are not found."""
    met = refusal(text)
    args = _arguments(exc)
    if met is None or args is None:
        return None
    site = args._ampdoctor_site
    config = getattr(args, "deepspeed", None)
    return refusal_finding(met, rung, site.file, site.line,
                           [os.path.abspath(config)] if isinstance(config, str) else [])


def refusal_finding(met: Refusal, rung: str, trainer_file: str, trainer_line: int,
                    config_files: list[str]) -> Finding:
    """The refusal as a `double-scaling` finding: at the Trainer's line (its TrainingArguments
    where known), the config key at its line in the first of `config_files` that sets it."""
    config_file, line = None, None
    for candidate in config_files:
        try:
            with open(candidate, encoding="utf-8") as f:
                line = text_locator(f.read())((met.section, "enabled"))
        except OSError:
            line = None
        if line is not None:
            config_file = candidate
            break
    kind = "Trainer fp32" if met.asked == "fp32" else f"Trainer {met.asked}"
    trainer = {"kind": kind, "file": trainer_file, "line": trainer_line, "key_path": None,
               "detail": "TrainingArguments handing DeepSpeed a config"}
    config_kind = f"DeepSpeed {met.section}" + ("" if met.state == "on" else " (off)")
    owner = {"kind": config_kind, "file": config_file or "(the config mapping)", "line": line,
             "key_path": met.config_key, "detail": f"{met.config_key}: {met.state}"}
    config_at = (f"{os.path.basename(config_file)}:{line} ({met.config_key})" if config_file
                 else f"the config mapping ({met.config_key})")
    return precisions_disagree(PrecisionsDisagree(
        rung, met.asked, f"{os.path.basename(trainer_file)}:{trainer_line}",
        f"{met.section}:{met.state}", met.config_key, config_at, met.outcome, trainer_file,
        (trainer, owner), location=Location(file=trainer_file, line=trainer_line)))
