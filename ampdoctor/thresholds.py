"""Every tolerance and classification threshold ampdoctor uses, in one place, with the reason
for its value. Change a number here, not in the module that uses it.

The per-precision comparison tolerances (`compare.DEFAULT_TOLERANCES`) are the judge's; the
numbers below are the rules': how close a measured factor must be to a known shape to name it.
"""

from __future__ import annotations

#: torch's clip_grad_norm_ divides by (total_norm + 1e-6); the reference does the same.
CLIP_EPSILON = 1e-6

#: A clip threshold divided by the loss scale equals a threshold the loop means (its
#: max_grad_norm, or what its fp32 run passed) to this relative precision: the loop clips
#: scaled gradients at a scaled threshold, which is the same update. Scales are powers of two
#: and thresholds are set by hand, so a real match is exact to float rounding.
SCALED_THRESHOLD_RTOL = 1e-3

#: A hypothesis (a gradient a known mistake would produce) names the mismatch when the consumed
#: gradient is within max(3 x the precision's rtol, this) of it, relative.
HYPOTHESIS_RTOL_FLOOR = 2e-3

#: A clip that bit must have seen the reference's unclipped norm of the same parameters: within
#: max(3 x rtol, this) in fp32 ...
PRECLIP_BAND_FP32 = 1e-3
#: ... and within this band in bf16 (rounding of a norm over a whole model).
PRECLIP_BAND_BF16 = 0.25

#: Per-step norm ratios of one run vary by more than this (max / min - 1): the divisor is a
#: count that changes from step to step, not a constant such as K.
VARYING_RATIO_SPREAD = 0.02

#: A scheduler's learning rate at an optimizer step equals the schedule's value for that step to
#: this relative precision (a constant schedule stepped per micro-batch changes nothing).
LR_RTOL = 1e-6

#: Same direction, same size in a reduced precision is rounding, not a bug (conv nets with
#: BatchNorm on micro-batches of a few samples differ from fp32 by 5-10 %, measured): every AMP
#: mistake moves the gradient by a factor (K, 1/K, b, S, 1/S) or turns it.
NOISE_MIN_COSINE = 0.95
NOISE_RATIO_BAND = (0.8, 1.25)

#: The clip-space rung forces max_grad_norm to this fraction of the true gradient norm so that
#: clipping really bites.
FORCED_CLIP_FRACTION = 0.1

#: clip-space: a clip's norm this far (log ratio) from the unscaled norm was taken in scaled
#: space.
CLIP_RATIO_LOG_BAND = 1.5

#: ddp-sync: a consumed gradient whose norm ratio to the global-batch reference is 1/world_size
#: to this relative precision (and points the same way) is the loss divided by the world size on
#: top of DDP's own averaging; fp32 runs make a real factor exact to rounding.
WORLD_SIZE_RATIO_RTOL = 1e-2
