"""What every kind's unit is made of: its catalogue entry (`Kind`), the rule-table row derived
from it (`Rule`), the generic observation (`Observed`) a unit's functions word and hand their
kind's decider (no module outside `ampdoctor/kinds/` builds one), and the static scan's
`AccumulationLoop`.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..core.enums import KindId, Severity
from ..core.evidence import Evidence
from ..core.findings import Location


@dataclass(frozen=True)
class Kind:
    """One diagnosis kind: what it is, why it matters, the fix, and how it is decided: the
    measured consequence that makes it an error (`error_when`), what its `evidence.measured`
    counts (`measured`), its one decider as an importable `module:function` (`decided_in`) and
    its fix in the terms of the framework that drove the run (`framework_fixes`, by
    `evidence.framework`; a framework not there takes `fix`, the hand-written loop's terms)."""

    name: KindId
    title: str
    why: str
    fix: str
    example: str = ""
    error_when: str = ""
    measured: str = ""
    decided_in: str = ""
    framework_fixes: dict[str, str] = field(default_factory=dict, hash=False)
    #: its own message says what a clip did (no lead for a rung that forced clipping)
    words_its_clip: bool = False
    #: its message when one of compare's hypotheses of it matched the consumed gradient
    #: (`kinds.matched`; fields {step}, {ratio}, {K}, {cos}, {label})
    matched: str = ""
    #: framework -> who divides by K there, said after the message when that framework drove
    #: the run (`kinds.matched`)
    who_divides: dict[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Rule:
    """Where a kind is decided and what its `evidence.measured` counts (the rule table: find a
    kind here, then open its decider)."""

    kind: KindId
    measured: str
    #: the one function that builds this kind's findings, importable as `module:function`
    decided_in: str


@dataclass(frozen=True)
class Observed:
    """What a rule or rung saw that a kind names: every field of the `Finding` but its kind
    (an empty `title` / `fix` takes the catalogue's)."""

    rung: str
    severity: Severity
    message: str
    evidence: Evidence = field(default_factory=lambda: Evidence())
    location: Location | None = None
    title: str = ""
    fix: str = ""
    traceback: str | None = None
    #: rung context: the threshold the clip-space rung forced clipping at (its finding says the
    #: update it judged was clipped there), None in a run clipped as the loop clips
    forced_clip: float | None = None

    def fields(self, kind: Kind) -> dict[str, Any]:
        """The keyword arguments of the `Finding` of `kind` (all but the rung, the kind and the
        severity), an empty title or fix taken from the kind's catalogue entry, the message led
        by the rung's context."""
        message = self.message
        if self.forced_clip is not None and not kind.words_its_clip:
            message = (f"With clipping forced (max_grad_norm={self.forced_clip:.4g}, a tenth of "
                       "the true gradient norm) the clipped update differs from the reference "
                       "clipped the way the loop meant: " + message)
        return {"message": message, "evidence": self.evidence, "location": self.location,
                "title": self.title or kind.title, "fix": self.fix or kind.fix,
                "traceback": self.traceback}


def in_framework_terms(kind: Kind, seen: Observed) -> Observed:
    """The observation with its fix in the terms of the framework that drove the run, when
    the rule wrote none of its own and the kind has one for it."""
    framework = seen.evidence.get("framework")
    fix = kind.framework_fixes.get(framework) if isinstance(framework, str) else None
    return replace(seen, fix=fix) if fix and not seen.fix else seen


#: A rung that forced fp16 onto a run whose own precision has no GradScaler: what it found is
#: what fp16 would do, said as such.
FORCED_FP16 = (" This training's own precision uses no GradScaler: this is what it would do "
               "in fp16, not a failure of the run as it trains.")


def skip_severity(consequence: bool, *, own_scaler: bool) -> Severity:
    """The skips rung's one rule for what may fail a run: a measured consequence is an error
    when the user's own precision uses a GradScaler; in a run the rung forced into fp16 (its own
    precision bf16 or fp32, no scaler, no skips) it is a warning about what fp16 would do."""
    return Severity.ERROR if consequence and own_scaler else Severity.WARNING


#: Said after a call order a script showed with no reference run: its consequence is unknown.
UNMEASURED = " (No reference was run, so whether the update differs was not measured.)"


def matched_but(why: str, message: str) -> str:
    """The warning of a call order whose fp16 updates all matched the reference: why it is
    still fragile, then what the call order was."""
    return f"Every fp16 update matched the reference, but {why}. ({message})"


def call_order_verdict(message: str, fragile: str, *, update_matched: bool,
                       unmeasured: bool) -> tuple[Severity, str]:
    """The severity and words of a call order the step state machine saw: an error where it
    explains a mismatch the judge found; a warning saying why it is `fragile` while every
    update matched; a warning saying nothing measured it (a script run without a reference)."""
    if unmeasured:
        return Severity.WARNING, message + UNMEASURED
    if update_matched:
        return Severity.WARNING, matched_but(fragile, message)
    return Severity.ERROR, message


# --- what `ampdoctor scan` reads in the code (its static hints) --------------------------------

#: The rung a static hint reports under (no rung of the ladder: nothing ran).
SCAN_RUNG = "scan"


@dataclass(frozen=True)
class AccumulationLoop:
    """An accumulation loop the static scan read in the code: its line, K as written (`k`, None
    when the code does not show it) and where the optimizer steps: on the iterations a test
    selects (`test` as written, at `test_line`) or, with no test, after the loop."""

    line: int
    step_line: int
    k: str | None = None
    test: str | None = None
    test_line: int | None = None

    @property
    def k_text(self) -> str:
        """K as the messages say it."""
        return self.k if self.k is not None else "K"

    def context(self) -> str:
        """Which loop, and where its optimizer steps."""
        if self.test is not None:
            where = (f"only on the iterations `{self.test}` selects (line {self.test_line}; the "
                     f"step at line {self.step_line})")
        else:
            where = f"after the loop (line {self.step_line})"
        return f"in the accumulation loop at line {self.line}, where the optimizer steps {where}"

    def evidence(self) -> Evidence:
        return {"static": True, "loop_line": self.line, "accumulation": self.k}
