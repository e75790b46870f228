"""What a script-mode diagnose is asked to run (`Command`) and what the rungs read of it in
place of a spec (`ScriptSpec`, `ScriptCode`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Command:
    """`ampdoctor diagnose SCRIPT.py [--steps N] [--reference-args ARGS] -- ARGS`."""

    script: str
    args: list[str]
    reference_args: list[str] | None
    steps: int = 3
    timeout_s: float = 600.0
    cwd: str = field(default_factory=os.getcwd)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    #: where each run's output is captured (None: shown on stderr as it runs)
    output_dir: str | None = None
    #: no reference args yet: the args with this batch option at K x b (`references.deferred`)
    defer_batch: str | None = None
    #: literals the reference's runs change in the script (`ScriptSource.reference_rewrites`)
    reference_rewrites: list[tuple[str, str, int, int, int]] | None = None


@dataclass
class ScriptSpec:
    """What the rungs read of `session.spec`, for a script."""

    script: str
    max_grad_norm: float | None = None
    micro_batch_size: int | None = None
    optimizer_steps: int = 3
    accumulation_steps: int = 1
    timeout_s: float = 600.0
    seed: int = 0
    tolerances: dict[str, Any] = field(default_factory=dict)
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16", "fp16"])
    rungs: list[str] | None = None
    keep_going: bool = False
    dropout: str = "off"
    device: str = "auto"

    #: the config files the script's engines were built from (a DeepSpeed `--deepspeed_config`):
    #: searched with the script for loss-scale owners, as `ampdoctor scan SCRIPT CONFIG` does
    config_files: list[str] = field(default_factory=list)

    def scan_paths(self) -> list[Path]:
        return [Path(self.script), *(Path(f) for f in self.config_files)]


class ScriptCode:
    """What the rungs read of `session.code`: no train_loop, no loss, the script's source."""

    train_loop = None
    loss = None

    def __init__(self, script: str):
        self.script = script

    def source_files(self) -> list[str]:
        return [self.script]
