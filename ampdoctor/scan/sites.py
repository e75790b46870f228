"""The data the double-scaling search produces: sites (owners and information) and the report.

A *site* is one place in the user's code or configs that says something about loss scaling:
a GradScaler construction, a DeepSpeed `fp16` section, `TrainingArguments(fp16=True)`... Its
`role` says what it means for the verdict:

- `owner`: a loss-scale state machine (it scales the loss and skips on overflow, or applies a
  constant scale);
- `possible`: an owner only under a condition decided elsewhere (DeepSpeed `"enabled": "auto"`);
- `use`: a `scaler.scale(loss)` whose GradScaler is built somewhere else;
- `info`: mixed precision without loss scaling (bf16), a disabled GradScaler, an engine whose
  config is not literal... shown to the user, never counted;
- `precision`: a precision setting that scales nothing and is not shown (a DeepSpeed section
  switched off, a Trainer that asks for fp32 while handing DeepSpeed a config): only compared
  with the other precision settings of its path (`scan.precision_agreement`).

This module must not import torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ampdoctor.core.findings import Finding, status_from_findings

#: Frameworks whose settings on one training path are one state machine however many places
#: mention them (a Trainer configured in code and in an args file is still one Trainer).
SINGLETON_FRAMEWORKS = frozenset({"deepspeed", "trainer", "accelerate", "lightning", "apex"})
#: Frameworks that hand fp16 to DeepSpeed when their site says so (`delegates`).
DELEGATING_FRAMEWORKS = frozenset({"trainer", "accelerate", "lightning"})

PYTHON_EXTS = (".py",)
CONFIG_EXTS = (".json", ".yaml", ".yml")
SHELL_EXTS = (".sh", ".bash")


class ScanPathError(FileNotFoundError):
    """A path given to the scan does not exist."""


@dataclass
class Site:
    kind: str
    file: str
    line: int | None = None
    key_path: str | None = None
    detail: str = ""
    role: str = "owner"  # owner | possible | use | info
    framework: str = ""  # gradscaler | static | deepspeed | trainer | accelerate | lightning | apex
    delegates: bool = False  # a framework site whose fp16 is handed to DeepSpeed
    end_line: int | None = None
    branch: tuple = ()  # ((if-id, arm), ...) for mutually exclusive branches in one file
    runtime: bool = False  # the fp16 run actually used this owner
    ref: str = ""  # for uses: the scaler expression, to merge uses of one scaler
    #: a precision setting as `scan.precision_agreement` compares them: a Trainer's literal ask
    #: ("fp32", "bf16", "fp16"), a DeepSpeed section's state ("fp16:on", "bf16:off",
    #: "fp16:unset" for a section without `enabled`, "bf16:auto"); "" for anything else
    precision: str = ""
    uid: int = -1

    def sort_key(self) -> tuple:
        is_code = self.file.endswith(PYTHON_EXTS)
        return (0 if is_code else 1, self.file, self.line or 0, self.key_path or "", self.kind)

    def where(self, base: str | None = None) -> str:
        text = display_path(self.file, base)
        if self.line is not None:
            text += f":{self.line}"
        if self.key_path:
            text += f" ({self.key_path})"
        return text

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind,
            "file": self.file,
            "line": self.line,
            "key_path": self.key_path,
            "detail": self.detail,
        }
        if self.runtime:
            data["runtime"] = True
        return data


def display_path(path: str, base: str | None = None) -> str:
    """`path` relative to `base` (default: the working directory) when it lies under it."""
    base = base if base is not None else os.getcwd()
    try:
        rel = os.path.relpath(path, base)
    except ValueError:  # another drive on Windows
        return path
    if rel == os.curdir or rel.startswith(os.pardir + os.sep) or rel == os.pardir:
        return path
    return rel


@dataclass
class FileScan:
    """What one file contributed: its sites, and what links it to other files."""

    path: str
    type: str  # python | config | shell
    root: str  # the scan root it was found under
    sites: list[Site] = field(default_factory=list)
    imports: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    refs: list[tuple[str, bool]] = field(default_factory=list)  # (string, follow if outside)
    consumes: set[str] = field(default_factory=set)
    config_types: set[str] = field(default_factory=set)
    skipped: str | None = None
    file_type: str | None = None  # "FIFO", "socket"...: skipped as not a regular file
    hints: list[Any] = field(default_factory=list)  # `scan.hints.Hint`s of a Python file


@dataclass
class ScanReport:
    paths: list[str]
    owners: list[Site] = field(default_factory=list)
    infos: list[Site] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    #: the static hints (`warning`s of other kinds: clipping before unscale_, a scheduler or
    #: zero_grad on every micro-batch, a loss never divided by K); see `scan.hints`
    hints: list[Finding] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    files_scanned: int = 0
    runtime_owner: dict[str, Any] | None = None
    seconds: float = 0.0
    display_base: str | None = None
    #: `--strict`: a hint fails the scan too (exit 1)
    strict: bool = False

    @property
    def status(self) -> str:
        return status_from_findings(self.findings)

    @property
    def exit_code(self) -> int:
        """CONTRACT §6: 1 when more than one loss-scale owner was found, else 0. Hints never
        change it, unless `strict`."""
        return 1 if self.findings or (self.strict and self.hints) else 0

    def to_dict(self) -> dict[str, Any]:
        from ampdoctor._version import __version__

        return {
            "ampdoctor_version": __version__,
            "command": "scan",
            "paths": list(self.paths),
            "verdict": self.status,
            "exit_code": self.exit_code,
            "files_scanned": self.files_scanned,
            "seconds": round(self.seconds, 3),
            "owners": [s.to_dict() for s in self.owners],
            "infos": [s.to_dict() for s in self.infos],
            "groups": self.groups,
            "findings": [f.to_dict() for f in self.findings],
            "hints": [h.to_dict() for h in self.hints],
            "strict": self.strict,
            "skipped": list(self.skipped),
            "runtime_owner": self.runtime_owner,
        }
