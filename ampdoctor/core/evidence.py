"""`Evidence`: the numbers a finding carries (`finding.evidence`, the record's `evidence`).

A typed dict, so mypy checks every key a rule or rung writes: a misspelt key, or a new one not
added here, fails `python -m mypy`. At run time it is a plain dict, so the record is unchanged.
Every key is optional (each kind fills the ones its rule measured); `measured` and `expected`
are the pair every kind's rule table entry describes (`kinds.RULES[kind].measured`), a count, a
ratio or a word by kind, so they stay `Any`, like the few keys whose value differs by rule.

Keys are grouped by what they describe; the functional form allows the two keys a killed
child's record uses that are not identifiers (`ddp.timeout_s`, `ampdoctor's start bound`: the
name of the bound the phase was given).

This module must not import torch: `report` and `explain` run without it.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

__all__ = ["Evidence", "significant"]


def significant(value: float, digits: int = 6) -> float:
    """`value` to `digits` significant figures, the one rounding of a number in the evidence
    (0, inf and nan as they are)."""
    if not math.isfinite(value) or value == 0:
        return value
    return float(f"{value:.{digits}g}")

Evidence = TypedDict("Evidence", {
    # the measured value against the expected one (see kinds.RULES[kind].measured)
    "measured": Any,
    "expected": Any,
    "tolerance": float,
    "threshold": float,
    # where in the run: the step, window, micro-batch, rank
    "step": Any,
    "window": int,
    "microbatch": Any,
    "microbatches": Any,
    "rank": Any,
    "world_size": int,
    "precision": str | None,
    "optimizer": Any,
    "injected_window": Any,
    "first_step_off": Any,
    "first_step_ranks_differ": Any,
    # the update against the reference
    "ratio": float | None,
    "cosine": float | None,
    "relative_error": float | None,
    "norm_user": float,
    "norm_reference": float,
    "norm_ratio": float,
    "ratio_after_clip": Any,
    "ratio_before_clip": Any,
    "ratio_spread": float,
    "ratios_per_step": list[float],
    "factor": Any,
    "count": Any,
    "hypothesis": str,
    "hypothesis_error": float,
    "resplit": Any,
    "framework": str,
    "config_gradient_accumulation_steps": int,
    "weighting_ratio": float,
    "weighting_cosine": float,
    "weights": Any,
    "reference_weights": Any,
    "per_microbatch_ratio": Any,
    "per_microbatch_cosine": Any,
    "accumulation_steps": int,
    "micro_batch_size": int,
    "contributing_microbatches": int,
    "early_clips": int,
    "window_microbatches": int,
    "parameters_not_cleared": int,
    # clipping
    "clip_total_norm": float,
    "clip_coefficient": Any,
    "meant_coefficient": Any,
    "max_grad_norm": Any,
    "norm_seen_by_clip": Any,
    "true_norm": Any,
    # the loss scale and skipped steps
    "scale": Any,
    "scale_before": Any,
    "scale_after": Any,
    "backoff_factor": Any,
    "growth_factor": Any,
    "growth_interval": Any,
    "extra_factor": Any,
    "skipped": Any,
    "skipped_steps": int,
    "steps": Any,
    "steps_after_first_update": Any,
    "skipped_after_first_update": Any,
    "skip_rate_after_first_update": Any,
    "initial_search_skips": Any,
    "search_skips_beyond_halvings": Any,
    "scale_resets": int,
    "scalers_built": int,
    "applied_windows": Any,
    "steps_on_nonfinite_gradients": Any,
    "zero_grad_on_skip_path": Any,
    "update_on_skip_path": Any,
    "scheduler_steps": Any,
    "steady_skip_rate": float,
    "calibration_skips": int,
    "steady_skips": int,
    "steps_after_settling": int,
    "lr_shift": float,
    "own_precision_scaled": bool,
    # counts of calls
    "optimizer_steps": Any,
    "backwards": Any,
    "microbatches_taken": Any,
    "microbatches_at_each_step": Any,
    "microbatches_before_first_step": Any,
    "steps_per_window": Any,
    "updates": Any,
    "updates_before_the_windows_step": Any,
    "scaler_steps": Any,
    "unscale_calls_in_step": int,
    "first_unscale": str,
    "max_between_optimizer_steps": Any,
    "lr_used": Any,
    "lr_expected": Any,
    # autocast, scaler and weight casts
    "autocast_entered": int,
    "autocast_enabled": Any,
    "scaler_enabled": Any,
    "cast": Any,
    "parameters": int,
    "parameters_cast": Any,
    # loss-scale owners (double-scaling) and the static scan
    "owners": list[dict[str, Any]],
    "scope": Any,
    "entry": Any,
    "entries": Any,
    "static": bool,
    # an HF Trainer and the DeepSpeed config it hands over disagreeing on the precision
    "trainer_precision": str,
    "config_key": str,
    "config_state": str,
    "outcome": str,
    "loss_scale": float,
    "accumulation": Any,
    "backward_line": int,
    "step_line": int,
    # DDP
    "allreduces_per_window": Any,
    "bytes_per_window": Any,
    "minimum_bytes_per_window": Any,
    "synced_backward_in_window": Any,
    "max_gradient_difference_between_ranks": Any,
    "parameter_difference_between_ranks": Any,
    "ranks_in_the_loop": Any,
    "ranks_past_the_loop": Any,
    # FSDP2 / HSDP
    "reduce_scatters_per_window": Any,
    "unsharded_gradient_bytes_not_held": int,
    "max_relative_error": float,
    "steps_with_a_gradient": int,
    "replica_all_reduces": Any,
    "windows_not_all_reduced": Any,
    # a loop that raised, hung or was killed
    "error": str,
    # the loop's own line: "file:line" of a loop that raised; the line number in a static hint
    "loop_line": str | int,
    "user_frames": list[str],
    "random_modules": list[str],
    "last_event": Any,
    "last_precision": Any,
    "last_step": Any,
    "killed_after_s": float,
    "exit_status": Any,
    "timeout_s": Any,
    "ddp.timeout_s": Any,
    "ampdoctor's start bound": Any,
    # the sentinel (`ampdoctor.watch`): what its counts saw in the first windows
    "backwards_per_step": list[int],
    "scheduler_steps_per_update": list[int],
}, total=False)
