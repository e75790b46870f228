"""Where the runs of a diagnose come from: a spec (a `train_loop`, or a framework entry point
that a spec names), or a script run as it is (`ampdoctor diagnose train.py -- ARGS`).

Both go through the same driver (CLI -> supervise -> worker -> runner -> ladder): a
`ScriptSource` is to a script what a `Spec` is to a spec, the validated settings of one
diagnose, with the command line's overrides (`--steps`, `--rungs`, `--precisions`,
`--device`, `--keep-going`) checked the way a spec's keys are and named by their flag when
they are wrong. It travels to the worker as JSON (`to_wire`/`from_wire`). No torch here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from ..core.errors import UsageError

#: The longest one run of the script may take (seconds), unless AMPDOCTOR_SCRIPT_TIMEOUT_S says.
DEFAULT_TIMEOUT_S = 600.0

#: The flag that sets each key on the command line: messages about an override name it, for a
#: spec (`cli/diagnose.py`) and a script alike.
FLAGS = {"device": "--device", "precisions": "--precisions", "rungs": "--rungs",
         "optimizer_steps": "--steps", "keep_going": "--keep-going",
         "reference_args": "--reference-args"}


def script_timeout_s() -> float:
    """The time bound of one run of a script: AMPDOCTOR_SCRIPT_TIMEOUT_S, else the default."""
    text = os.environ.get("AMPDOCTOR_SCRIPT_TIMEOUT_S", "").strip()
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError as exc:
        raise UsageError(f"AMPDOCTOR_SCRIPT_TIMEOUT_S={text!r}: give a number of seconds") \
            from exc
    if not value > 0:
        raise UsageError(f"AMPDOCTOR_SCRIPT_TIMEOUT_S={text!r}: give a positive number of "
                         "seconds")
    return value


Precision = Literal["fp32", "bf16", "fp16"]
Origin = Literal["given", "inferred"]


def _every_precision() -> list[Precision]:
    return ["fp32", "bf16", "fp16"]


class ScriptSource(BaseModel):
    """One diagnose of a script: what runs (the script, its args, the reference's args) and
    the settings a spec would give (steps, rungs, precisions, device, keep_going)."""

    model_config = ConfigDict(extra="forbid")

    script: str
    args: list[str] = Field(default_factory=list)
    #: the reference's command line (K = 1, batch K x b); None: none could be had
    reference_args: list[str] | None = None
    #: how the reference's args were had: "given" (--reference-args) or "inferred"
    reference_origin: Origin | None = None
    #: how an inferred reference was read from the script ("--accum-steps 4 (ARGS) -> 1, ...")
    reference_how: str | None = None
    #: the reference is the run's args with this batch option set to K x b, once the first fp32
    #: step shows K (a script that derives K from a total batch)
    reference_batch_option: str | None = None
    #: literals of the script the reference's runs change: (role "K"/"batch", name, line, column,
    #: value) (K and the micro-batch written in the script, `script.constants`)
    reference_rewrites: list[tuple[str, str, int, int, int]] | None = None
    optimizer_steps: StrictInt = Field(default=3, ge=1, le=1_000_000)
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0)
    device: str = "auto"
    precisions: list[Precision] = Field(default_factory=_every_precision, min_length=1)
    rungs: list[str] | None = Field(default=None, min_length=1)
    keep_going: bool = False
    #: keep the script's own output (each run's) in the record instead of showing it as it
    #: runs (`--verbose` shows it)
    capture_output: bool = True
    #: the working directory the script runs in (the caller's)
    cwd: str = Field(default_factory=os.getcwd)

    @field_validator("rungs")
    @classmethod
    def _rung_ids(cls, value: list[str] | None) -> list[str] | None:
        from . import check_rung_ids
        return check_rung_ids(value)

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, value: list[str]) -> list[str]:
        from . import check_precisions
        return check_precisions(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        from . import check_device
        return check_device(value)

    # --- what the driver reads of a source (as of a Spec) ----------------------------------
    #: no `ddp` section: a script runs in one process (the ddp-sync rung is skipped)
    ddp: None = None

    @property
    def display_name(self) -> str:
        return os.path.splitext(os.path.basename(self.script))[0]


def script_source(script: Path, args: list[str], reference_args: list[str] | None,
                  origin: Origin | None, **overrides: Any) -> ScriptSource:
    """The validated source; UsageError naming the flag of a bad override (exit 2)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ScriptSource(script=str(script), args=list(args), reference_args=reference_args,
                            reference_origin=origin, timeout_s=script_timeout_s(), **given)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            key = str(error["loc"][0]) if error["loc"] else "?"
            flag = FLAGS.get(key, key)
            value = given.get(key)
            message = str(error["msg"]).removeprefix("Value error, ")
            lines.append(f"{flag} {_shown(value)}: {message}")
        raise UsageError("\n".join(lines), cause=exc) from exc


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def to_wire(source: ScriptSource) -> str:
    return json.dumps({"script_source": source.model_dump(mode="json")})


def from_wire(text: str) -> ScriptSource:
    return ScriptSource.model_validate(json.loads(text)["script_source"])


def is_script_wire(text: str) -> bool:
    return text.lstrip().startswith('{"script_source"')
