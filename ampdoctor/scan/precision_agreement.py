"""An HF Trainer's `fp16`/`bf16` against the DeepSpeed config it hands over (`deepspeed=`).

With `TrainingArguments(deepspeed=...)` the Trainer does not scale the loss itself: the
DeepSpeed engine does, as its config says, and two settings own the precision of that one
engine. What the packages do when they disagree (transformers 5.25, accelerate 1.16, DeepSpeed
0.19.8, measured):

- a config section left `"auto"` (or absent) is filled in from the Trainer: no disagreement;
- the config enables the other half precision than the Trainer asks for (fp16 under a bf16
  Trainer, bf16 under an fp16 one): accelerate refuses when the Trainer is built ("`--mixed_
  precision` arg cannot be set to `bf16` when `fp16` is set in the DeepSpeed config file");
- the config enables fp16 or bf16 under a Trainer that asks for neither, or switches off
  (`enabled: false`) the one it asks for: transformers refuses when `train()` starts ("Please
  correct the following DeepSpeed config values that mismatch TrainingArguments values");
- the config's section of the precision the Trainer asks for has no `enabled` at all: nobody
  refuses, DeepSpeed leaves it off, and the engine trains in fp32.

One error per disagreeing Trainer and config on a training path, at the Trainer's line, with
the config key beside it; where several configs stand on the path (alternatives a command line
chooses among) and one of them agrees, none. Only literal settings are compared: a Trainer whose
precision is decided at run time (`fp16=args.fp16`) may agree with its config, and is not judged
here (`ampdoctor diagnose` runs it and reads what the packages refuse).
"""

from __future__ import annotations

from collections import defaultdict

from ampdoctor.core.enums import RungId
from ampdoctor.core.findings import Finding, Location
from ampdoctor.kinds.double_scaling import Outcome, PrecisionsDisagree, precisions_disagree
from ampdoctor.scan.sites import Site

RUNG = RungId.DOUBLE_SCALING

#: the Trainer's sites that hand DeepSpeed a config, and what each asks for ("" : decided at
#: run time, an fp16 Trainer only maybe)
_TRAINER = {"Trainer fp16", "Trainer bf16", "Trainer fp32"}


def _site_dict(site: Site) -> dict[str, object]:
    return {"kind": site.kind, "file": site.file, "line": site.line, "key_path": site.key_path,
            "detail": site.detail}


def disagreement(asked: str, states: dict[str, tuple[str, Site]]) -> tuple[Outcome, Site] | None:
    """What the packages do with a Trainer asking for `asked` ("fp32", "bf16", "fp16", or ""
    for an fp16 decided at run time) and a config whose sections are in `states` (section ->
    (state, its site)); None where they agree."""
    other = {"bf16": "fp16", "fp16": "bf16"}
    if asked == "":
        # `fp16=args.fp16`, `fp16=run.precision == "fp16"`: one of its values may well agree
        # with the config (as with alternative configs on one path, below): no verdict
        return None
    if asked in other:
        mine = asked
        state = states.get(other[mine])
        if state is not None and state[0] == "on":
            return Outcome.REFUSED_BY_ACCELERATE, state[1]
        state = states.get(mine)
        if state is not None and state[0] == "off":
            return Outcome.REFUSED_BY_TRANSFORMERS, state[1]
        if state is not None and state[0] == "unset":
            return Outcome.RUNS_FP32, state[1]
        return None
    for section in ("fp16", "bf16"):
        state = states.get(section)
        if state is not None and state[0] == "on":
            return Outcome.REFUSED_BY_TRANSFORMERS, state[1]
    return None


def trainer_deepspeed_mismatch(paths: list[tuple[str, list[Site], frozenset[int]]],
                               base: str | None) -> list[Finding]:
    """The Trainer-vs-DeepSpeed-config precision disagreements on each training path."""
    findings: list[Finding] = []
    seen: set[tuple[int, int]] = set()
    for entry, found, _ in paths:
        trainers = [s for s in found if s.kind in _TRAINER and s.delegates]
        configs: dict[str, dict[str, tuple[str, Site]]] = defaultdict(dict)
        for site in found:
            if ":" in site.precision:
                section, state = site.precision.split(":", 1)
                configs[site.file].setdefault(section, (state, site))
        for trainer in trainers:
            verdicts = [disagreement(trainer.precision, states) for states in configs.values()]
            if len(verdicts) > 1 and None in verdicts:
                # alternative configs on one path (a `--deepspeed` the command line chooses):
                # one agrees, so the Trainer may well be launched with that one
                continue
            for met in verdicts:
                if met is None or (trainer.uid, met[1].uid) in seen:
                    continue
                outcome, config = met
                seen.add((trainer.uid, config.uid))
                findings.append(precisions_disagree(PrecisionsDisagree(
                    RUNG, trainer.precision or "fp16", trainer.where(base),
                    config.precision, config.key_path or "", config.where(base), outcome,
                    entry, (_site_dict(trainer), _site_dict(config)),
                    location=Location(file=trainer.file, line=trainer.line or 1))))
    return findings
