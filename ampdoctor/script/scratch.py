"""The scratch folder of one script-mode diagnose (`ScriptSession`): each run of the script gets a
folder of it, where its file writes land (`files.Overlay`, in the child), removed when the run
ends; the whole folder goes with the session. What the runs wrote and removed (original paths)
is kept for the record's notes."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any

from ..core import processes

#: how the note on the script's files starts (one note, replaced as runs add to it)
NOTE = "the script's file writes went to a scratch folder,"


class Scratch:
    """The scratch folder of a diagnose and what its runs wrote there (module docstring)."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="ampdoctor-script-", dir=processes.temp_root())
        weakref.finalize(self, shutil.rmtree, self.root, True)
        self.runs = 0
        self.written: set[str] = set()
        self.removed: set[str] = set()

    def folder(self) -> str:
        """A new run's folder (made by the run)."""
        self.runs += 1
        return os.path.join(self.root, f"run-{self.runs}")

    def absorb(self, files: dict[str, Any], notes: set[str]) -> set[str]:
        """A finished run's report of its files (`Outcome.files`); `notes` with the note on
        the script's files brought up to date."""
        self.written.update(files.get("written", ()))
        self.removed.update(files.get("hidden", ()))
        note = self.note()
        return {n for n in notes if not n.startswith(NOTE)} | ({note} if note else set())

    def record(self) -> dict[str, Any]:
        """Where the script's file writes went (for the record)."""
        return {"scratch": self.root, "written": sorted(self.written),
                "removed": sorted(self.removed), "kept": "removed after each run"}

    def note(self) -> str | None:
        if not self.written and not self.removed:
            return None
        parts = []
        if self.written:
            parts.append(f"wrote {_some(self.written)}")
        if self.removed:
            parts.append(f"removed or moved {_some(self.removed)} (left in place)")
        return (f"{NOTE} {self.root} (a folder per run, deleted when the run ended): the "
                f"script {' and '.join(parts)}; no file outside it was changed")


def _some(paths: set[str]) -> str:
    shown = sorted(paths)
    return ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
