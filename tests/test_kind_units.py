"""Each kind's unit from a hand-built observation: the severity on both sides of its boundary
and the words and numbers of its message, computed here (a ratio from two norms written in the
test, a rate from two counts), not by ampdoctor. The end-to-end recipes check the same kinds
from real runs (tests/test_e2e_diagnose.py, tests/test_frameworks.py, tests/test_script_mode.py).
"""

from __future__ import annotations

import pytest

from ampdoctor.enums import KindId, RungId, Severity
from ampdoctor.findings import Location
from ampdoctor.kinds import CATALOGUE
from ampdoctor.kinds.baseline import NotRepeatable, Runs, not_repeatable

LINE = Location("train.py", 12, "train_loop", "x = x + torch.randn_like(x)")


# --- nondeterministic-baseline --------------------------------------------------------------

def test_two_loop_runs_that_differ_are_an_error_naming_the_draw():
    # two runs' norms 1.0 and 1.0125: relative difference 0.0125
    rel = abs(1.0125 - 1.0) / 1.0
    finding = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.LOOP, rel_err=rel,
                                           cosine=0.99991234, tolerance=1e-5,
                                           random_modules=(), random_site=LINE,
                                           location=LINE))
    assert (finding.kind, finding.severity) == (KindId.NONDETERMINISTIC_BASELINE,
                                                Severity.ERROR)
    assert finding.message.startswith(
        "Two fp32 runs of the loop from the same weights differ by 0.0125 (relative) under a "
        "different RNG state (cosine 0.99991).")
    assert "(first at train.py:12)" in finding.message
    assert finding.evidence == {"measured": 0.0125, "expected": 0.0, "tolerance": 1e-5,
                                "cosine": 0.999912, "random_modules": []}
    assert finding.location == LINE
    assert finding.title == CATALOGUE[KindId.NONDETERMINISTIC_BASELINE].title


@pytest.mark.parametrize("aligned, says", [
    (False, "Random layers active in the model: Dropout(p=0.1)."),
    (True, "their forwards were aligned per micro-batch, so the randomness comes from "
           "elsewhere")])
def test_random_layers_are_named_aligned_or_not(aligned, says):
    finding = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.REFERENCE,
                                           rel_err=3e-3, cosine=0.5, tolerance=1e-5,
                                           random_modules=("Dropout(p=0.1)",),
                                           aligned=aligned))
    assert says in finding.message
    assert finding.message.startswith("Two fp32 reference gradients at the same weights "
                                      "differ by 0.003 (relative)")


def test_a_script_reading_different_data_is_a_warning_with_nothing_measured():
    """The boundary: nothing was compared, so nothing fails."""
    finding = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.SCRIPT_DATA,
                                           location=LINE))
    assert finding.severity is Severity.WARNING
    assert finding.evidence == {"measured": "different data", "expected": "the same data"}
    assert "without a fixed seed" in finding.message


def test_script_runs_and_script_reference_are_errors_with_their_difference():
    rel = (2.5 - 2.0) / 2.0      # 0.25
    runs = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.SCRIPT, rel_err=rel,
                                        tolerance=1e-5, random_site=LINE, location=LINE))
    assert runs.severity is Severity.ERROR
    assert "(relative difference 0.25)" in runs.message
    assert "(it draws random numbers at train.py:12)" in runs.message
    assert runs.evidence == {"measured": 0.25, "expected": 0.0, "tolerance": 1e-5}
    ref = not_repeatable(NotRepeatable(RungId.REPRODUCIBILITY, Runs.SCRIPT_REFERENCE,
                                       rel_err=rel))
    assert ref.message == ("Two runs of the reference (--reference-args) at the same weights "
                           "differ by 0.25 (relative): the fp32 reference is not repeatable.")
    assert ref.evidence == {"measured": 0.25, "expected": 0.0}
