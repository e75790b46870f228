"""The kind of an update off the reference in no known shape: `gradient-mismatch`.

Each kind here is one unit: its catalogue text (`ampdoctor explain` prints it), the measured
consequence that makes it an error (`error_when`, which docs/kinds.md repeats), what its
`evidence.measured` counts, its fix in a framework's terms, and its one decider (`decided_in`),
the only function that builds a `Finding` of it.

This module must not import torch: the static scan, `report` and `explain` run without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core import thresholds
from ..core.enums import KindId, Severity
from ..core.evidence import Evidence, significant
from ..core.findings import Finding, Location
from .base import Kind, Observed
from .sync import RanksCompared, words_of

GRADIENT_MISMATCH = Kind(
    KindId.GRADIENT_MISMATCH,
    title="The update differs from the reference in no known shape",
    why=(
        "The gradient the optimizer consumed differs from the fp32 full-batch reference beyond the "
        "tolerance, and the difference matches none of the known shapes (a factor K, 1/K, b, "
        "S...). "
        "Also reported for an off-by-one window condition, a loop that stops early, and DDP ranks "
        "that consume different gradients."),
    fix=(
        "Compare the loop with the correct skeleton: `loss / K` -> `scaler.scale(loss).backward()` "
        "x K -> `scaler.unscale_` -> clip -> `scaler.step` -> `scaler.update` -> `zero_grad`, "
        "stepping when `(i + 1) % K == 0`; the finding names the first bad step and its numbers."),
    example=(
        "for i, (x, y) in enumerate(micro_batches):\n"
        "    scaler.scale(criterion(model(x), y) / K).backward()\n"
        "    if i % K == 0:                # off by one: steps after micro-batch 0\n"
        "        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()"),
    error_when=(
        "a consumed update differs from the reference beyond tolerance in no known shape "
        "(always with the numbers and the first bad step)."),
    measured="consumed / reference gradient norm, first bad step",
    decided_in=f"{__name__}:gradient_mismatch",
)


def gradient_mismatch(seen: Observed) -> Finding:
    """`gradient-mismatch`: the update differs from the reference in no known shape.
    Error: an update off the reference in no known shape. (`GRADIENT_MISMATCH.error_when`)"""
    return Finding(seen.rung, KindId.GRADIENT_MISMATCH, seen.severity,
                   **seen.fields(GRADIENT_MISMATCH))


@dataclass(frozen=True)
class OffBoundary:
    """An optimizer whose first step came after a count of micro-batches that is no multiple
    of K (an off-by-one accumulation condition): the micro-batches consumed at each step."""

    rung: str
    optimizer: int
    K: int
    consumed: tuple[int, ...]
    location: Location | None = None


OFF_BY_ONE_TITLE = "The optimizer steps off the window boundaries (off by one)"


def off_boundary(o: OffBoundary) -> Finding:
    """`gradient-mismatch` of an off-by-one window: every window after the first straddles
    two (an error)."""
    first = o.consumed[0]
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"The optimizer stepped after {first} micro-batch(es), not on a boundary of "
        f"K={o.K}: the accumulation condition is off by one (e.g. "
        "`i % K == 0` with i counted from 0), so the first window holds "
        f"{first} micro-batch(es) and every later window straddles two.",
        evidence={"measured": first, "expected": o.K,
                  "microbatches_at_each_step": list(o.consumed), "optimizer": o.optimizer},
        location=o.location, title=OFF_BY_ONE_TITLE,
        fix="Step when the count of micro-batches seen is a multiple of K: "
            "`if (i + 1) % K == 0:` with i counted from 0 (or count from 1)."))


@dataclass(frozen=True)
class TooFewSteps:
    """The fp32 loop stepped fewer times than there are windows (`steps`, 0: never, with the
    backwards it ran; `lightning_none`: it stepped but no backward ran before any step)."""

    rung: str
    steps: int
    windows: int
    K: int
    taken: int                  # micro-batches the loop took
    microbatches: int           # micro-batches it was handed
    backwards: int = 0
    called_step: int = 0        # optimizer.step() calls (with no backward before any)
    location: Location | None = None


def too_few_steps(o: TooFewSteps) -> Finding:
    """`gradient-mismatch` of windows that never reach the model: an error."""
    if o.steps == 0:
        how = ("it never called optimizer.step()" if not o.called_step else
               f"it called optimizer.step() {o.called_step} time(s), but no backward ran "
               "before any of them (a Lightning `training_step` that returns None skips the "
               "backward and the step: return the loss)")
        return gradient_mismatch(Observed(o.rung, Severity.ERROR,
            f"No optimizer step was taken in {o.taken} micro-batches: the fp32 loop took "
            f"{o.taken} of {o.microbatches} micro-batches and ran {o.backwards} backward "
            f"pass(es); {how}.",
            evidence={"measured": 0, "expected": o.windows, "microbatches_taken": o.taken,
                      "backwards": o.backwards, "optimizer_steps": o.called_step},
            location=o.location))
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"The fp32 loop took {o.steps} optimizer step(s) for the {o.windows} windows of "
        f"K={o.K} micro-batches in the spec (it took {o.taken} of {o.microbatches} "
        "micro-batches): it stops early or never steps for the last windows, so those "
        "windows' data never reaches the model.",
        evidence={"measured": o.steps, "expected": o.windows, "microbatches_taken": o.taken,
                  "microbatches": o.microbatches},
        location=o.location))


@dataclass(frozen=True)
class Unexplained:
    """The judge's first bad step in no known shape: its ordinal and window, the precision,
    the numbers of the comparison (relative error, norm ratio, cosine, tolerance) and the
    comparison keys. `shape_tried`: the rules looked for a known shape (else the step's
    weights were gone and only the numbers are said)."""

    rung: str
    step: int
    window: int
    precision: str
    rel_err: float
    ratio: float
    cosine: float
    tolerance: float
    comparison: Evidence
    shape_tried: bool = True
    forced_clip: float | None = None
    location: Location | None = None
    #: clips that bit between the window's backwards (on a partial sum of its micro-batches),
    #: the location then being the first of them
    early_clips: int = 0


def unexplained(o: Unexplained) -> Finding:
    """`gradient-mismatch`: an update off the reference in no known shape (an error)."""
    if not o.shape_tried:
        return gradient_mismatch(Observed(o.rung, Severity.ERROR,
            f"Step {o.step}: the optimizer consumed a gradient {o.rel_err:.3g} "
            f"(relative) from the {o.precision} reference (norm ratio "
            f"{o.ratio:.4g}, cosine {o.cosine:.4f}).",
            evidence=o.comparison, location=o.location, forced_clip=o.forced_clip))
    hint = ""
    if o.cosine > thresholds.SAME_DIRECTION_COSINE:   # only the size is off
        hint = f" The direction is right (cosine {o.cosine:.5f}); only the size differs."
    if o.early_clips:
        hint += (f" The window's gradient was clipped {o.early_clips} time(s) before its last "
                 "backward, on a partial sum of its micro-batches: clip once, after the last "
                 "backward and before the step (gated by `accelerator.sync_gradients` or "
                 "`(i + 1) % K == 0`).")
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"Step {o.step} (window {o.window}) of the "
        f"{o.precision} run: the gradient the optimizer consumed differs "
        f"from the fp32 reference by {o.rel_err:.3g} (relative; tolerance "
        f"{o.tolerance:g}), norm ratio {o.ratio:.4g}, cosine "
        f"{o.cosine:.4f}, matching no known mistake.{hint}",
        evidence=o.comparison, location=o.location, forced_clip=o.forced_clip))


CLIP_AFTER_STEP_FIX = (
    "Clip before the step that consumes the gradients: `scaler.unscale_(optimizer)`, then "
    "`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, then "
    "`scaler.step(optimizer)` and `scaler.update()` (without a scaler: clip, then "
    "`optimizer.step()`).")


@dataclass(frozen=True)
class ClipAfterStep:
    """A clip that bit after the optimizer step that consumed the gradients: the norm it saw,
    its threshold, the judged update/reference norm ratio of that step (None when unknown)."""

    rung: str
    step: int
    total_norm: float
    max_norm: float
    tolerance: float
    ratio: float | None = None
    forced_clip: float | None = None
    location: Location | None = None


def clip_after_step(o: ClipAfterStep) -> Finding:
    """`gradient-mismatch` of a clip after its step: the update used an unclipped gradient (an
    error)."""
    factor = o.total_norm / o.max_norm
    evidence: Evidence = {"measured": significant(factor), "expected": 1.0, "step": o.step,
                          "clip_total_norm": significant(o.total_norm),
                          "max_grad_norm": significant(o.max_norm), "tolerance": o.tolerance}
    if o.ratio is not None:   # the update against the unclipped reference: it matched
        evidence["ratio"] = significant(o.ratio)
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"Step {o.step}: the gradient clip ran after the optimizer step, on gradients the "
        f"step had already consumed: their norm was {o.total_norm:.4g} against "
        f"max_norm={o.max_norm:.4g}, so the update used a gradient {factor:.4g}x the "
        "clipped one the loop means, and the clip only rescaled gradients about to be "
        "cleared.",
        evidence=evidence, location=o.location, fix=CLIP_AFTER_STEP_FIX,
        forced_clip=o.forced_clip))


@dataclass(frozen=True)
class NeverSynced:
    """A DDP / FSDP run in which no backward synchronised: every backward ran with sync off."""

    rung: str
    who: str                    # the wrapper (`kinds.sync.WORDS`' "who")
    sharded: bool               # FSDP2: the sharded .grad stays None without a sync
    windows: int
    stepped: int                # rank 0's optimizer steps that consumed a gradient
    steps_judged: int
    ranks: RanksCompared
    location: Location | None = None


def never_synced(o: NeverSynced) -> Finding:
    """`gradient-mismatch` of a run whose ranks never synchronised: an error (each rank stepped
    on its own shard, or, sharded, no rank stepped at all)."""
    words = words_of(o.who)
    what = (f"sync was never turned back on, so the sharded .grad stayed None on every "
            f"rank and no rank stepped at all: rank 0 consumed a gradient at {o.stepped} of "
            f"its {o.steps_judged} optimizer steps (the optimizer skips a parameter "
            "without a gradient) and the weights never moved, while each rank's unsharded "
            "gradient kept accumulating unseen." if o.sharded else
            "so each rank stepped on its own shard and the ranks' parameters ended "
            f"{o.ranks.drift:.3g} apart (relative).")
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"{words['who']} never {words['verb']} a gradient: every backward ran with "
        f"{words['switch']}; {what}",
        evidence={"measured": 0, "expected": o.windows, "steps_with_a_gradient": o.stepped,
                  **o.ranks.evidence()},
        location=o.location,
        fix=("Turn sync back on for the last micro-batch of every window, before its "
             "forward: model.set_requires_gradient_sync(i % K == K - 1)." if o.sharded
             else "")))


@dataclass(frozen=True)
class ReplicasNeverAllReduced:
    """HSDP reduce-scattered inside each node but no backward all-reduced across the replicas
    (set_requires_all_reduce(False), never turned back on)."""

    rung: str
    windows: int
    missed: tuple[int, ...]     # the windows whose last backward did not all-reduce
    stepped: int                # rank 0's optimizer steps that consumed a gradient
    steps_judged: int
    ranks: RanksCompared
    location: Location | None = None


def replicas_never_all_reduced(o: ReplicasNeverAllReduced) -> Finding:
    """`gradient-mismatch`: FSDP2 held every reduce-scatter's output aside, no rank stepped;
    an error."""
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        "HSDP reduce-scattered inside each node but never all-reduced across the "
        "replicas (set_requires_all_reduce(False), never turned back on): FSDP2 holds each "
        "reduce-scatter's output aside until an all-reduce, so the sharded .grad stayed "
        f"None and no rank stepped at all (rank 0 consumed a gradient at {o.stepped} of its "
        f"{o.steps_judged} optimizer steps).",
        evidence={"measured": 0, "expected": o.windows, "steps_with_a_gradient": o.stepped,
                  "replica_all_reduces": 0, "windows_not_all_reduced": list(o.missed),
                  **o.ranks.evidence()},
        location=o.location,
        fix="Turn the all-reduce back on for the last micro-batch of every window, before "
            "its forward: model.set_requires_all_reduce(i % K == K - 1)."))


@dataclass(frozen=True)
class RanksApart:
    """One sync per window, on its last backward, yet the ranks consumed different gradients:
    the loop does something per rank."""

    rung: str
    who: str
    ranks: RanksCompared
    other_rank: int                         # the rank compared with rank 0
    #: where the two ranks' calls part ways: (the call, its file, its line)
    parted: tuple[str, str, int] | None = None
    location: Location | None = None


def ranks_apart(o: RanksApart) -> Finding:
    """`gradient-mismatch` of ranks that consumed different gradients: an error (their
    parameters drift apart)."""
    words = words_of(o.who)
    how = (f" Rank 0 and rank {o.other_rank} part ways at {o.parted[0]} "
           f"({o.parted[1]}:{o.parted[2]})." if o.parted else "")
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"The ranks consumed different gradients ({o.ranks.max_difference:.3g} apart, "
        f"relative, first at step {o.ranks.first_apart}) although {words['who']} "
        f"{words['verb']} once per window on its last backward: something in the loop is "
        "rank-dependent (a clip, a scale or a branch on the rank), so the ranks' parameters "
        f"drift apart ({o.ranks.drift:.3g} after the run).{how}",
        evidence={"measured": round(o.ranks.max_difference, 6), "expected": 0.0,
                  **o.ranks.evidence()},
        location=o.location))


@dataclass(frozen=True)
class RateOffReference:
    """A script's optimizer stepped with another learning rate than its reference (the same
    script without accumulation) at the same optimizer step: each gradient matched, the update
    did not."""

    rung: str
    step: int
    group: int                  # the first parameter group whose rate differs
    run_lr: float
    ref_lr: float
    reference_args: str         # the reference's command-line arguments
    K: int
    micro_batch_size: int | None   # the spec's, where it names one
    scheduled: bool             # a scheduler stepped in the run (its pace may be the cause)
    location: Location | None = None

    @property
    def ratio(self) -> float:
        return self.run_lr / self.ref_lr if self.ref_lr else math.inf


def rate_off_reference(o: RateOffReference) -> Finding:
    """`gradient-mismatch` of the learning rate: an error (every update is `ratio` x the one
    the same training without accumulation makes)."""
    ratio = o.ratio
    if not o.scheduled:
        cause = ("the script sets the optimizer's learning rate from the micro-batch (a "
                 "linear scaling rule on the batch option alone?), not from the optimizer "
                 f"step's batch of K x b = {o.K} x {o.micro_batch_size}")
        fix = ("compute it from the effective batch: batch size x accumulation steps "
               "(x world size)")
    else:
        cause = ("the script derives the learning rate from the micro-batch, or its "
                 "schedule (warm-up, length) from the number of micro-batches (len(loader)) "
                 "instead of optimizer steps")
        fix = ("compute the learning rate from the effective batch (batch size x "
               "accumulation steps) and count the schedule in optimizer steps (len(loader) "
               "// accumulation steps per epoch)")
    group_text = f" (parameter group {o.group})" if o.group else ""
    message = (f"Step {o.step}: the optimizer's learning rate{group_text} is {o.run_lr:.6g} in "
               f"the run and {o.ref_lr:.6g} in the reference ({o.reference_args}), "
               f"{ratio:.4g}x: {cause}. Each gradient matches the full-batch one, but every "
               f"update is {ratio:.4g}x the one the same training without accumulation makes. "
               f"Fix: {fix}.")
    return gradient_mismatch(Observed(
        o.rung, Severity.ERROR, message,
        evidence={"measured": round(ratio, 6) if math.isfinite(ratio) else str(ratio),
                  "expected": 1.0, "step": o.step, "lr_used": o.run_lr,
                  "lr_expected": o.ref_lr},
        location=o.location))


@dataclass(frozen=True)
class EngineScaleOff:
    """A DeepSpeed engine whose optimizer consumed the reference's gradient times a factor that
    is the engine's own loss scale (`factor` = 1/S or S, S = `loss_scale`), in a loop whose own
    code is right: DeepSpeed unscaled a loss it never scaled, or scaled one it never unscaled
    (its ZeRO-0 fp16 path at 0.19.x: `engine.backward` does not multiply the loss by the
    scale that `FP16_Optimizer.step` divides by, upstream PR #8393). `config_key`: the config
    key that sets S, where `location` points."""

    rung: str
    step: int
    precision: str
    ratio: float            # consumed / reference gradient norm
    cosine: float
    loss_scale: float       # the engine's loss scale S
    factor: float           # the known factor the ratio matched (1/S or S)
    config_key: str
    tolerance: float
    comparison: Evidence
    location: Location | None = None


def engine_scale_off(o: EngineScaleOff) -> Finding:
    """`gradient-mismatch` of a framework update that is not what its config asks for: an
    error, at the config key that sets the scale, not the loop's loss line."""
    power = math.log2(o.loss_scale) if o.loss_scale > 0 else float("nan")
    scale = f"2^{power:g}" if power == int(power) else f"{o.loss_scale:g}"
    shown = f"1/{o.loss_scale:g}" if o.factor < 1 else f"{o.loss_scale:g}"
    evidence: Evidence = {**o.comparison, "measured": significant(o.ratio),
                          "expected": 1.0, "factor": shown, "loss_scale": o.loss_scale,
                          "config_key": o.config_key, "framework": "DeepSpeed"}
    return gradient_mismatch(Observed(o.rung, Severity.ERROR,
        f"Step {o.step} of the {o.precision} run: DeepSpeed's engine handed its optimizer "
        f"{significant(o.ratio):g} x the reference gradient (cosine {o.cosine:.4f}), which is "
        f"{shown}: the engine's own loss scale ({scale}, from `{o.config_key}`). The loop "
        "drives the engine as DeepSpeed documents (engine.backward / engine.step); the engine "
        f"{'unscaled a loss it never scaled' if o.factor < 1 else 'never unscaled its loss'}, "
        "so every update is off by that factor (DeepSpeed's ZeRO-0 fp16 path does this: its "
        "FP16_Optimizer.step divides by the scale engine.backward never applied).",
        evidence=evidence, location=o.location,
        fix=("A DeepSpeed defect, not the loop's: run fp16 under ZeRO stage 1 or higher (its "
             "optimizer scales and unscales the same loss), or bf16, or a DeepSpeed release "
             "with the ZeRO-0 fp16 backward fixed. Setting the scale to 1 "
             f"(`{o.config_key}`) hides the factor but leaves fp16 unscaled.")))
