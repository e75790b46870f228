"""Rung `reproducibility`: the fp32 reference is repeatable, so later differences mean something.

Two checks. The reference gradient at the initial weights, computed twice under different RNG
states, must agree (a dropout layer or a random loss fails here). Two fp32 runs of the user's
loop from identical weights and data, again under different RNG states, must agree on the first
optimizer step: the repeat run is stopped there (the whole first run is fp32-accum's to judge).
"""

from __future__ import annotations

from ..core import thresholds
from ..core.enums import RungId, Status
from ..core.findings import Finding, RungResult, status_from_findings
from ..kinds.baseline import NotRepeatable, Runs, not_repeatable
from ..maths import compare
from ..probe.callsite import Site
from ..probe.events import StepRecord
from ..session import Session, WeightsCast
from .analysis import location

RUNG = RungId.REPRODUCIBILITY


def repeat_tolerance() -> compare.Tolerance:
    """How far two fp32 evaluations of the same computation may differ
    (thresholds.REPEAT_RTOL, thresholds.REPEAT_ATOL)."""
    return compare.Tolerance(rtol=thresholds.REPEAT_RTOL, atol=thresholds.REPEAT_ATOL)


def _nondeterministic(session: Session, runs: Runs, m: compare.Metrics,
                      random_site: Site | None = None) -> Finding:
    modules = session.random_modules()
    site = random_site
    if site is None and modules:
        site = session.module_sites.get(modules[0].split(" ")[0])
    return not_repeatable(NotRepeatable(
        RUNG, runs, rel_err=m.rel_err, cosine=m.cosine, tolerance=repeat_tolerance().rtol,
        random_modules=tuple(modules), aligned=session.align_seed is not None,
        random_site=location(random_site), location=location(site)))


def run(session: Session) -> RungResult:
    names = session.param_order
    seed = session.spec.seed
    try:
        first = session.reference(0, rng_seed=seed + 11, per_mb=False)
        second = session.reference(0, rng_seed=seed + 12, per_mb=False)
    except WeightsCast as exc:
        # the loop-as-reference casts the weights: fp32-accum names the cast (half-open-amp)
        cast = exc.trace.cast
        assert cast is not None   # (raised for a cast only)
        dtype = cast.dtypes[0].removeprefix("torch.")
        return RungResult(RUNG, Status.SKIP, f"no fp32 reference from the loop: it casts the "
                          f"model's weights to {dtype} (see fp32-accum)")
    m = compare.metrics_of(second.full, first.full, names, session.param_shapes,
                           repeat_tolerance())
    if not m.ok:
        finding = _nondeterministic(session, Runs.REFERENCE, m)
        return RungResult(RUNG, Status.FAIL, "the fp32 reference is not repeatable", [finding])
    session.reference_repeatable = True
    if m.rel_err == 0:
        session.remember_reference(0, second)   # the judge's first reference, already computed
    mode = first.mode
    del first, second   # not held through the fp32 runs (the session keeps the one it reuses)

    run_a = session.trace("fp32")
    if run_a.error is not None:
        return RungResult(RUNG, Status.PASS, "the fp32 reference is repeatable (the loop itself "
                          "raised; see fp32-accum)", [],
                          details={"reference_mode": mode})
    from .fp32_accum import no_gradient_stepped
    if not run_a.steps or no_gradient_stepped(run_a):
        return RungResult(RUNG, Status.PASS, "the fp32 reference is repeatable (the loop took "
                          "no optimizer step to compare; see fp32-accum)", [],
                          details={"reference_mode": mode})
    worst = None
    compared = 0
    # The repeat run stops after its first optimizer step (every optimizer's): randomness in the
    # loop shows there already, and the later steps would only cost passes.
    first_group = [s for s in run_a.steps if s.group == run_a.steps[0].group] if run_a.steps \
        else []

    def against_run_a(step_b: StepRecord) -> bool:
        # streamed: each step of the second run is compared as it happens, then dropped;
        # true once the first group is compared (the probe then stops the run)
        nonlocal worst, compared
        if compared >= len(first_group):
            return True
        step_a = first_group[compared]
        compared += 1
        keys = [n for n in step_a.grads if n in session.param_shapes]
        mm = compare.metrics_of(step_b.grads, step_a.grads, keys, session.param_shapes,
                                repeat_tolerance())
        if worst is None or mm.rel_err > worst.rel_err:
            worst = mm
        return compared >= len(first_group)

    run_b = session.run_loop("fp32", rng_seed=seed + 2, step_sink=against_run_a)
    steps_b = [s for s in run_b.steps if s.group == run_b.steps[0].group] if run_b.steps else []
    if len(first_group) != len(steps_b) or (worst is not None and not worst.ok):
        m = worst or compare.metrics(compare.torch.zeros(1), compare.torch.ones(1),
                                     repeat_tolerance())
        site = run_a.random_site or run_b.random_site
        finding = _nondeterministic(session, Runs.LOOP, m, site)
        return RungResult(RUNG, Status.FAIL, "two fp32 runs of the loop disagree", [finding])
    findings: list[Finding] = []
    summary = (f"reference repeatable ({mode} mode); two fp32 runs agree "
               f"(max relative difference {worst.rel_err if worst else 0:.2g})")
    return RungResult(RUNG, status_from_findings(findings), summary, findings,
                      details={"reference_mode": mode,
                               "loop_repeat_error": worst.rel_err if worst else 0.0})
