"""The ladder of a script (CONTRACT §3, §8): the same rungs, in the same order, with the same
ids and kinds as a spec's; where a rung reads the judge, it is spec mode's own rung run on the
`ScriptSession`.

What only a script has: a rung whose precision the script cannot run is `skip` with the reason
(it never enters autocast; fp16 without a GradScaler in a bf16 script), and without a usable
reference (no `--reference-args`, or a reference that reads other data) the rungs keep what the
runs' own traces say -- the step state machine, the scheduler, double scaling, the skips -- and
say what they could not compare.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..core import thresholds
from ..core.enums import RungId, Status
from ..core.errors import UserCodeError
from ..core.findings import Finding, RungResult, conclude, location
from ..kinds.baseline import NotRepeatable, Runs, not_repeatable
from ..kinds.clipping import ScaledClip, ScriptScaledClip, script_scaled_clip
from ..kinds.scaling import SecondUnscale, StepOnScaled
from ..kinds.stepping import ZeroedInside, zeroed_inside
from ..ladder import amp, clip_space, fp32_accum, precision_rungs, skips
from ..ladder.analysis import loop_error_finding, scheduler_findings
from ..ladder.casts import weight_cast_finding
from ..ladder.reproducibility import repeat_tolerance
from ..maths import compare
from ..probe.events import Backward, Clip, EngineBuilt, Scale, ZeroGrad
from ..rules.scale_state import call_order_finding, runtime_double_scaling, violation_observations
from .lrs import lr_mismatch
from .references import Grads
from .session import ScriptSession, ScriptTrace

NO_REFERENCE = ("no reference to compare the updates with: give --reference-args, the "
                "script's arguments for one micro-batch per optimizer step holding the whole "
                "step's data (K = 1, batch K x b)")


def _no_reference(ss: ScriptSession) -> str:
    if ss.command.reference_args is None:
        return NO_REFERENCE
    return (f"the reference does not read the run's data ({ss.unaligned}): nothing compared. "
            "The script draws or orders its data differently for another batch size (random "
            "data per step, a shuffle without a seeded generator): seed it or turn shuffling "
            "off in both argument lists. Or the model runs more than one forward per "
            "micro-batch (two views of each sample), which script mode cannot align: write a "
            "spec for that loop")


# --- reproducibility ---------------------------------------------------------------------
def _diverging_baseline(trace: ScriptTrace, group: int) -> None:
    """UserCodeError (exit 3), as for a spec's reference, when the fp32 run's first optimizer
    step consumed a gradient that is not finite: the script's own fp32 training diverges (a
    NaN or inf loss), so no comparison, and no repeat of it, means anything."""
    for step in (s for s in trace.steps if s.group == group):
        bad = next((n for n, g in step.grads.items()
                    if isinstance(g, torch.Tensor) and not compare.all_finite(g)), None)
        if bad is not None:
            backward = next(iter(trace.events_of(Backward)), None)
            site = backward.site if backward is not None else step.site
            raise UserCodeError(
                f"the script's fp32 run consumed a gradient that is not finite at its first "
                f"optimizer step (parameter {bad}): its fp32 training itself diverges (a NaN or "
                "inf loss), so nothing can be compared. Check the data and the loss in fp32 "
                "first", location=(site.file, site.line) if site is not None else None)


def reproducibility(ss: ScriptSession) -> RungResult:
    """Two fp32 runs of the script from the same weights read the same data and consume the
    same first update; two reference runs at those weights agree."""
    rung = RungId.REPRODUCIBILITY
    first = ss.trace("fp32")
    if first.error is not None or not first.steps:
        why = ("raised" if first.error is not None and first.steps else "did not step")
        return RungResult(rung, Status.PASS, f"nothing to repeat: the fp32 run {why} (see "
                          "fp32-accum)")
    again = ss.run(ss.repeat_job(), "repeat fp32 run", ahead="repeat")
    a, b = first.outcome.forwards, again.forwards
    K = ss.K
    if [f.digests for f in a[:K]] != [f.digests for f in b[:K]]:
        reason = ("two runs of the same command read different data in their first window "
                  f"({K} micro-batch(es)): the script draws or shuffles its data without a "
                  "fixed seed")
        ss.unaligned = ss.unaligned or reason
        finding = not_repeatable(NotRepeatable(
            rung, Runs.SCRIPT_DATA, location=location(first.outcome.events[0].site
                                                      if first.outcome.events else None)))
        return conclude(rung, [finding], "")
    group = first.steps[0].group
    _diverging_baseline(first, group)
    steps_a = [s for s in first.steps if s.group == group]
    steps_b = [s for s in again.steps if s.group == (again.steps[0].group if again.steps
                                                      else -1)]
    worst = None
    for sa, sb in zip(steps_a, steps_b, strict=False):
        names = [n for n in sa.grads if n in ss.param_shapes]
        m = compare.metrics_of(sb.grads, sa.grads, names, ss.param_shapes, repeat_tolerance())
        worst = m if worst is None or m.rel_err > worst.rel_err else worst
    if len(steps_a) != len(steps_b) or (worst is not None and not worst.ok):
        rel = worst.rel_err if worst is not None else float("nan")
        site = first.random_site
        finding = not_repeatable(NotRepeatable(
            rung, Runs.SCRIPT, rel_err=rel, tolerance=repeat_tolerance().rtol,
            random_site=location(site), location=location(site)))
        return RungResult(rung, Status.FAIL, "two fp32 runs of the script disagree", [finding])
    summary = (f"two fp32 runs agree (max relative difference "
               f"{worst.rel_err if worst else 0:.2g}) on the same data")
    if ss.has_reference:
        pair = _reference_pair(ss)
        if pair is None:
            pair = (ss.reference(0, ss.initial_state, rng_seed=1).full,
                    ss.reference(0, ss.initial_state, rng_seed=2).full)
        m = compare.metrics_of(pair[1], pair[0], ss.param_order, ss.param_shapes,
                               repeat_tolerance())
        if not m.ok:
            finding = not_repeatable(NotRepeatable(rung, Runs.SCRIPT_REFERENCE,
                                                   rel_err=m.rel_err))
            return RungResult(rung, Status.FAIL, "the fp32 reference is not repeatable", [finding])
        ss.reference_repeatable = True
        summary = "reference repeatable; " + summary
    return RungResult(rung, Status.PASS, summary, details={"reference_mode": "script"})


def _reference_pair(ss: ScriptSession) -> tuple[Grads, Grads] | None:
    """Two fp32 reference gradients of the first window at the run's initial weights from runs
    the diagnose made anyway: the first reference run (at its own initial weights) and the one
    teacher-forced to the fp32 run's windows. None unless the reference's own initial weights
    are the run's (then two runs of their own are made)."""
    first, forced = ss.reference_probe, ss.window_reference
    if first is None or forced is None or not first.ref_grads or not forced.ref_grads \
            or not first.ref_grads[0] or not forced.ref_grads[0]:
        return None
    own, run = first.initial_state or {}, ss.initial_state
    if not own or set(own) != set(run) or any(not torch.equal(own[k], run[k]) for k in own):
        return None
    return first.ref_grads[0], forced.ref_grads[0]


# --- precision rungs ---------------------------------------------------------------------
def fp32_accum_rung(ss: ScriptSession) -> RungResult:
    rung = RungId.FP32_ACCUM
    if ss.has_reference:
        result = fp32_accum.run(ss)  # type: ignore[arg-type]
        if result.status is Status.FAIL:
            return result
        lr = lr_mismatch(ss, ss.trace("fp32"))
        return result if lr is None else conclude(rung, [*result.findings, lr], "")
    trace = ss.trace("fp32")
    return _without_reference(ss, trace, rung)


def _without_reference(ss: ScriptSession, trace: ScriptTrace, rung: RungId) -> RungResult:
    """A rung's checks that read the run alone; its updates not compared (the reason said)."""
    cast = weight_cast_finding(ss, trace, rung)  # type: ignore[arg-type]
    if cast is not None:
        return conclude(rung, [cast], "")
    if trace.error is not None:
        return conclude(rung, [loop_error_finding(trace, rung)], "")
    findings: list[Finding] = []
    if trace.precision != "fp32":
        findings += amp.half_open_findings(ss, trace, rung)  # type: ignore[arg-type]
    if trace.precision == "fp16" and not any(f.severity == "error" for f in findings):
        for v in violation_observations(ss, trace, rung):  # type: ignore[arg-type]
            if isinstance(v, (ScaledClip, StepOnScaled, SecondUnscale)):
                # a call order whose consequence was not measured: at most a warning
                v = replace(v, unmeasured=True)
            findings.append(call_order_finding(v))
        double = runtime_double_scaling(ss.trace("fp32"), trace, rung)
        if double is not None:
            findings.append(double)
    if trace.precision == "fp32":
        inside = _zero_grad_inside(trace)
        if inside is not None:
            findings.append(inside)
    findings += scheduler_findings(ss, trace, rung)  # type: ignore[arg-type]
    if findings:
        return conclude(rung, findings, f"{len(trace.steps)} optimizer step(s) run; "
                        + _no_reference(ss))
    return RungResult(rung, Status.SKIP, _no_reference(ss))


def _zero_grad_inside(trace: ScriptTrace) -> Finding | None:
    """A zero_grad between two backwards of one window (read from the trace alone): the step
    consumes only the micro-batches after it. Unmeasured without a reference: a warning."""
    previous = -1
    for step in trace.steps:
        window = [e for e in trace.events if previous < e.seq < step.seq]
        previous = step.seq
        backwards = [e for e in window if isinstance(e, Backward)]
        if len(backwards) < 2:
            continue
        zeros = [e for e in window if isinstance(e, ZeroGrad)
                 and backwards[0].seq < e.seq < backwards[-1].seq]
        if zeros:
            after = sum(1 for b in backwards if b.seq > zeros[-1].seq)
            return zeroed_inside(ZeroedInside(RungId.FP32_ACCUM, after, len(backwards),
                                              location=location(zeros[-1].site)))
    return None


def _autocast_requests(ss: ScriptSession) -> list[dict[str, Any]]:
    return list(ss.trace("fp32").outcome.autocasts)


def _scaler_requests(ss: ScriptSession) -> list[dict[str, Any]]:
    return list(ss.trace("fp32").outcome.scalers)


def unavailable(ss: ScriptSession, precision: str) -> str | None:
    """Why the script cannot be run in `precision` as written (the skip's reason), or None."""
    fp32 = ss.trace("fp32")
    if fp32.error is not None:
        return "the fp32 run raised (see fp32-accum)"
    if fp32.events_of(EngineBuilt):   # the engine's config sets it (`script.deepspeed`)
        return amp.bf16_supported(ss) if precision == "bf16" else None  # type: ignore[arg-type]
    requests = _autocast_requests(ss)
    # an autocast for another device (`torch.cuda.amp.autocast()` on a machine without CUDA)
    # changes nothing the model computes here
    autocasts = [a for a in requests if a.get("device") == ss.device.type]
    if not autocasts:
        other = next((a for a in requests if a.get("device")), None)
        where = (f" (its autocast is for {other['device']}, at {_short(other.get('site'))})"
                 if other is not None else "")
        return (f"the script never enters autocast on {ss.device.type}{where}: it trains in "
                f"fp32 only, so there is no {precision} run to make of it")
    if precision == "fp16" and not _scaler_requests(ss):
        asked = {a["dtype"] for a in autocasts} - {None}
        if "float16" not in asked:
            dtype = ", ".join(sorted(asked)) or "its device's default"
            return (f"the script builds no GradScaler and asks autocast for {dtype}: it "
                    "trains without loss scaling, so it cannot run fp16 as written")
    if precision == "bf16":
        return amp.bf16_supported(ss)  # type: ignore[arg-type]
    return None


def _short(site: Any) -> str:
    return f"{os.path.basename(site.file)}:{site.line}" if site is not None else "?"


def fp16_unavailable(ss: ScriptSession) -> str | None:
    """Why there is no fp16 run for the rungs that read one: the script cannot run it, or its
    DeepSpeed engine refused it on this device (the fp16-scaler rung's skip says so)."""
    reason = unavailable(ss, "fp16")
    if reason is None and ss.trace("fp32").events_of(EngineBuilt):
        changed = amp.framework_change(ss.trace("fp16"))
        if changed is not None and changed[1]["precision_ran"] is None:
            return changed[0]
    return reason


def precision_rung(precision: str) -> Callable[[ScriptSession], RungResult]:
    rung = RungId.BF16_NO_SCALER if precision == "bf16" else RungId.FP16_SCALER

    def run(ss: ScriptSession) -> RungResult:
        reason = unavailable(ss, precision)
        if reason:
            return RungResult(rung, Status.SKIP, reason)
        if ss.has_reference:
            return amp.run_precision(ss, precision, rung)  # type: ignore[arg-type]
        return _without_reference(ss, ss.trace(precision), rung)

    return run


def double_scaling(ss: ScriptSession) -> RungResult:
    return precision_rungs.run_double_scaling(ss)


def clip_space_rung(ss: ScriptSession) -> RungResult:
    rung = RungId.CLIP_SPACE
    reason = fp16_unavailable(ss)
    if reason:
        return RungResult(rung, Status.SKIP, f"no fp16 run: {reason}")
    if not ss.trace("fp16").events_of(Clip):
        return RungResult(rung, Status.SKIP, "the script never clips its gradients")
    if not ss.has_reference:
        return _clip_space_from_trace(ss, ss.trace("fp16"))
    return clip_space.run(ss)  # type: ignore[arg-type]


def _clip_space_from_trace(ss: ScriptSession, trace: ScriptTrace) -> RungResult:
    """Without a reference: the norm each clip saw over the norm after unscale_ (1 in true
    space, the loss scale S in scaled space), and what the clip did with it. A clip in scaled
    space that shrank the gradient by another factor than the same threshold would in true
    space changed the update: an error; one that did nothing either way, a warning."""
    rung = RungId.CLIP_SPACE
    if trace.error is not None:
        return RungResult(rung, Status.SKIP, "the fp16 run raised (see fp16-scaler)")
    ratios = clip_space._clip_ratios(trace)
    details = {"clip_ratios": [compare._round(r) for r in ratios]}
    scales = [e.scale for e in trace.events_of(Scale) if e.scale]
    scale = scales[-1] if scales else None
    clips = [c for c in trace.events_of(Clip) if c.clip_kind == "norm" and c.total_norm
             and c.max_norm]
    if not ratios or scale is None or not clips:
        return RungResult(rung, Status.SKIP, _no_reference(ss), details=details)
    low, high = thresholds.SECOND_SCALE_BAND
    scaled = [r for r in ratios if low <= r / scale <= high]
    if not scaled:
        shown = ", ".join(f"{r:.4g}" for r in ratios[:3])
        return RungResult(rung, Status.PASS, f"every clip saw the true gradient norm (norm ratio "
                          f"to unscaled {shown}); " + _no_reference(ss), details=details)
    clip = clips[0]
    assert clip.total_norm is not None and clip.max_norm is not None
    finding = script_scaled_clip(ScriptScaledClip(rung, clip.total_norm, scale, clip.max_norm,
                                                  location=location(clip.site)))
    return conclude(rung, [finding], "", details)



def skips_rung(ss: ScriptSession) -> RungResult:
    reason = fp16_unavailable(ss)
    if reason:
        return RungResult(RungId.SKIPS, Status.SKIP, f"no fp16 run: {reason}")
    return skips.run(ss)  # type: ignore[arg-type]


def ddp_sync(ss: ScriptSession) -> RungResult:
    return RungResult(RungId.DDP_SYNC, Status.SKIP, "script mode runs the script in one process; "
                      "the ddp-sync rung needs a spec with `ddp`")


RUNGS: dict[str, Callable[[ScriptSession], RungResult]] = {
    "reproducibility": reproducibility,
    "fp32-accum": fp32_accum_rung,
    "bf16-no-scaler": precision_rung("bf16"),
    "fp16-scaler": precision_rung("fp16"),
    "double-scaling": double_scaling,
    "clip-space": clip_space_rung,
    "skips": skips_rung,
    "ddp-sync": ddp_sync,
}


def ahead(ss: ScriptSession) -> list[str]:
    """The runs the ladder will ask for that need nothing but the fp32 run, in the order it
    asks (`ScriptSession.plan`): the repeat of the fp32 run, the bf16 run and the fp16 run,
    each where a rung asked for reads it and the script can run it."""
    from ..ladder import skipped
    names = ["repeat"] if skipped(ss, RungId.REPRODUCIBILITY) is None else []
    for precision, rungs in (("bf16", (RungId.BF16_NO_SCALER,)),
                             ("fp16", (RungId.FP16_SCALER, RungId.CLIP_SPACE, RungId.SKIPS))):
        if any(skipped(ss, r) is None for r in rungs) and unavailable(ss, precision) is None:
            names.append(precision)
    return names


def weights(ss: ScriptSession) -> dict[str, float]:
    """Each rung's cost in runs of the script (its own runs and the reference runs they
    need), for the progress estimate: reproducibility repeats the fp32 run and the reference;
    fp32-accum reads the runs the start made; each precision, the forced clip and the injected
    overflow are a run (and its reference run when there is one)."""
    per_run = 2.0 if ss.has_reference else 1.0
    clips = ss.spec.max_grad_norm is not None     # clip-space and skips share one fp16 run
    return {"reproducibility": 1.0 + (2.0 if ss.has_reference else 0.0),
            "fp32-accum": 0.1, "bf16-no-scaler": per_run, "fp16-scaler": per_run,
            "double-scaling": 0.1, "clip-space": per_run if clips else 0.05,
            "skips": 0.1 if clips else per_run, "ddp-sync": 0.01}
