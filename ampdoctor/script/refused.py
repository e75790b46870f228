"""A script's first run stopped by transformers or accelerate refusing its HF Trainer over the
DeepSpeed config's precision (`rules.trainer_precision`): not the user's bare error, the
double-scaling rung's (`diagnose` names the two settings, as `ampdoctor scan` does)."""

from __future__ import annotations

from typing import Any

from ..core.errors import UserCodeError
from ..rules.trainer_precision import Refusal, refusal


class PrecisionsRefused(UserCodeError):
    """The script's first run was refused by transformers or accelerate: its Trainer's
    precision and the DeepSpeed config it hands over disagree."""

    def __init__(self, message: str, met: Refusal,
                 location: tuple[str, int] | None = None) -> None:
        super().__init__(message, location=location)
        self.refusal = met


def refused(outcome: Any) -> None:
    """Raise PrecisionsRefused when a run (a child's `Outcome`) stopped on that refusal."""
    error = outcome.error or {}
    text = str(error.get("text") or "")
    met = refusal(text)
    if met is None:
        return
    site = error.get("site")
    raise PrecisionsRefused(
        f"the script stopped before its first optimizer step: {met.meaning()} "
        f"({text.splitlines()[0][:200] if text else ''})", met,
        location=(site.file, site.line) if site is not None else None)
