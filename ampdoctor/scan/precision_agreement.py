"""An HF Trainer's `fp16`/`bf16` against the DeepSpeed config it hands over (`deepspeed=`).

With `TrainingArguments(deepspeed=...)` the Trainer does not scale the loss itself: the
DeepSpeed engine does, as its config says. Where the Trainer asks for one precision and the
config enables the other (explicitly, not `"auto"`), two settings own the precision of one
engine and disagree: transformers refuses the contradiction when it starts, and code that
bypasses that check trains in a precision nobody asked for. One error per such pair on a
training path, at the Trainer's line, with the config key beside it.
"""

from __future__ import annotations

from ampdoctor.enums import RungId
from ampdoctor.findings import Finding, Location
from ampdoctor.kinds.double_scaling import PrecisionsDisagree, precisions_disagree
from ampdoctor.scan.configs import BF16_AUTO
from ampdoctor.scan.sites import Site

RUNG = RungId.DOUBLE_SCALING

_TRAINER = {"Trainer fp16": "fp16", "Trainer bf16": "bf16"}
_CONFIG = {"DeepSpeed fp16": "fp16", "DeepSpeed bf16": "bf16"}


def _site_dict(site: Site) -> dict[str, object]:
    return {"kind": site.kind, "file": site.file, "line": site.line, "key_path": site.key_path,
            "detail": site.detail}


def trainer_deepspeed_mismatch(paths: list[tuple[str, list[Site], frozenset[int]]],
                               base: str | None) -> list[Finding]:
    """The Trainer-vs-DeepSpeed-config precision disagreements on each training path."""
    findings: list[Finding] = []
    seen: set[tuple[int, int]] = set()
    for entry, found, _ in paths:
        trainers = [s for s in found if s.kind in _TRAINER and s.delegates]
        # (a section left "auto" is filled in from the Trainer: no disagreement)
        configs = [s for s in found if s.kind in _CONFIG and s.role in ("owner", "info")
                   and not s.detail.startswith(BF16_AUTO)]
        config_precisions = {_CONFIG[s.kind] for s in configs}
        for trainer in trainers:
            asked = _TRAINER[trainer.kind]
            if not config_precisions or asked in config_precisions:
                continue
            config = configs[0]
            if (trainer.uid, config.uid) in seen:
                continue
            seen.add((trainer.uid, config.uid))
            enabled = _CONFIG[config.kind]
            findings.append(precisions_disagree(PrecisionsDisagree(
                RUNG, asked, trainer.where(base), enabled, config.where(base), entry,
                (_site_dict(trainer), _site_dict(config)),
                location=Location(file=trainer.file, line=trainer.line or 1))))
    return findings
