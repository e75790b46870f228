"""Every tolerance and classification threshold ampdoctor uses, in one place, with the reason
for its value. Change a number here, not in the module that uses it.

Code reads them as attributes of this module at the moment it decides (`thresholds.NAME`, never
`from .thresholds import NAME`), so that a test can move any one of them and see a verdict
change (tests/test_thresholds.py does, for every number here). Pure Python, no torch: the report
and the static scan import it too.

Not here: numbers that decide nothing (array and chunk sizes, display widths, timeouts) and the
1e-30 floors that only keep a division by a zero norm finite.
"""

from __future__ import annotations

# --- the judge: a consumed gradient against the fp32 reference -------------------------------

#: The default tolerance of each precision (`compare.DEFAULT_TOLERANCES`; a spec's `tolerances`
#: overrides them): a step matches when ||g - r|| <= rtol ||r|| + atol sqrt(n), n its number of
#: elements. From the noise floor measured on the healthy recipes (README "Tolerances"): fp32
#: teacher-forced relative error 3e-7 on the recipes' small models but 4.4e-5 on a 22M-parameter
#: model (summation order grows with size), bf16 ~1e-2, fp16 ~1e-3. The defaults sit well above
#: the floor and far below the smallest factor of a real bug (one micro-batch of K = 100
#: missing is 1e-2).
FP32_RTOL = 1e-3
FP32_ATOL = 1e-7
BF16_RTOL = 1e-1
BF16_ATOL = 1e-5
FP16_RTOL = 5e-2
FP16_ATOL = 1e-6

#: Same direction, same size in a reduced precision is rounding, not a bug (conv nets with
#: BatchNorm on micro-batches of a few samples differ from fp32 by 5-10 %, measured): every AMP
#: mistake moves the gradient by a factor (K, 1/K, b, S, 1/S) or turns it. A bf16/fp16 step
#: beyond its tolerance whose cosine to the reference is at least NOISE_MIN_COSINE and whose
#: norm ratio lies in NOISE_RATIO_BAND (both ends included) is precision noise
#: (`compare.is_precision_noise`; the charts draw the band, the rung's summary states both).
NOISE_MIN_COSINE = 0.95
NOISE_RATIO_BAND = (0.8, 1.25)

#: A comparison built from several gradients (a hypothesis vector from the per-micro-batch
#: references, the norm a clip saw against the reference's, a count-weighted mean) adds up
#: their roundings: it is allowed this many times the precision's rtol (a margin, not a
#: measurement: every known mistake is a factor of 2 or more, or turns the gradient).
RTOL_MULTIPLE = 3

#: A hypothesis (a gradient a known mistake would produce) names the mismatch when the consumed
#: gradient is within max(RTOL_MULTIPLE x the precision's rtol, this) of it, relative
#: (`compare.hypothesis_tolerance`); the same allowance decides which count the loop weighs
#: micro-batches by (`judge.weighting_of`).
HYPOTHESIS_RTOL_FLOOR = 2e-3

#: `judge.weighting_of`: a count-weighted mean names the loop's weighting only when the loop's
#: gradient is at least 1 / this times closer to it than to the equal-weight mean (a clear
#: winner, never a near tie between two guesses).
WEIGHTING_MARGIN = 0.1

#: A clip that bit must have seen the reference's unclipped norm of the same parameters: within
#: max(RTOL_MULTIPLE x rtol, this) in fp32 ...
PRECLIP_BAND_FP32 = 1e-3
#: ... and within this band in bf16 (rounding of a norm over a whole model).
PRECLIP_BAND_BF16 = 0.25

#: torch's clip_grad_norm_ divides by (total_norm + 1e-6); the reference does the same, and a
#: clip bites when max_norm / (total_norm + this) < 1.
CLIP_EPSILON = 1e-6

#: A clip threshold divided by the loss scale equals a threshold the loop means (its
#: max_grad_norm, or what its fp32 run passed) to this relative precision: the loop clips
#: scaled gradients at a scaled threshold, which is the same update. Scales are powers of two
#: and thresholds are set by hand, so a real match is exact to float rounding. (The clip-space
#: rung tells the same way whether the loop clipped at the threshold it was handed.)
SCALED_THRESHOLD_RTOL = 1e-3

# --- the rules: which known shape a mismatch has -----------------------------------------------

#: A norm ratio names a count (an integer multiple of the micro-batch size, the tokens or labels
#: every micro-batch of the window shares) when it equals it to this relative precision: a count
#: is exact, and a factor in fp32 is exact to rounding.
COUNT_RATIO_RTOL = 0.01

#: The re-split pass (K equal to the micro-batch size b) names "no average" when the gradient's
#: factor follows K' = K // 2 and "sum reduction" when it stays at b, each to this relative
#: precision: both runs are fp32 on the same micro-batches, so the real factor is exact to
#: rounding, and K' and b differ by at least one.
RESPLIT_RATIO_RTOL = 0.02

#: A mismatch whose cosine to the reference is above this points the right way: only its size
#: is off (a loss summed over a count; otherwise the message says so). A gradient that lost
#: micro-batches or kept an earlier window's is turned far more.
SAME_DIRECTION_COSINE = 0.999
#: ... and when it is also at least this many times the reference, a loss summed over a count
#: of the window (the smallest such count, 2, gives 2x; no factor gives 1x).
SUMMED_MIN_RATIO = 1.5

#: Same direction up to rounding: a divisor scales the gradient without turning it (a wrong
#: divisor, a divisor that varies per step).
EXACT_DIRECTION_COSINE = 0.9999
#: A norm ratio within this of 1 (absolute) is no size factor: a wrong divisor names a ratio
#: off by more, a varying divisor needs some step off by more.
RATIO_NEAR_ONE = 0.05
#: A wrong divisor (a hard-coded 8 for K = 4, K x K) is named only for a ratio strictly inside
#: this range: a factor beyond it is too large for a divisor mix-up (a loss scale S = 2**16, or
#: 1/S, is far beyond).
WRONG_DIVISOR_RATIO_RANGE = (0.05, 20)

#: Per-step norm ratios of one run vary by more than this (max / min - 1): the divisor is a
#: count that changes from step to step, not a constant such as K.
VARYING_RATIO_SPREAD = 0.02

#: The clip-before-unscale hypothesis (a clip whose norm was taken before unscale_) is tried
#: only when the reference clipped at max_grad_norm bites, i.e. its coefficient is below this
#: (a coefficient of ~1 makes the hypothesis the reference divided by S, which unscale-twice
#: already covers).
CLIP_BITES_BELOW = 0.999

#: The loss reaching backward is S x (fp32 loss) x c: |c| inside this band (ends included) is
#: the scaler's scale alone (the first fp16 backward's loss is within a few % of fp32's); outside
#: it, a second, hand-written scale (powers of two: apex's 128, 2**16).
SECOND_SCALE_BAND = (0.5, 2.0)

#: A scheduler's learning rate at an optimizer step equals the schedule's value for that step to
#: this relative precision (a constant schedule stepped per micro-batch changes nothing).
LR_RTOL = 1e-6

# --- the rungs ---------------------------------------------------------------------------------

#: Two fp32 evaluations of the same computation on CPU agree bit for bit; this leaves room for
#: reduction-order noise on GPUs while staying far below any real randomness (dropout: ~1e-1).
#: (The reproducibility rung's tolerance, rtol and atol as in the per-precision ones.)
REPEAT_RTOL = 1e-5
REPEAT_ATOL = 1e-8

#: frequent-skips: after the first real update, more than this fraction of the plain fp16 run's
#: steps skipped; or no update at all in the run; or the scale below MIN_SCALE. The default
#: GradScaler skips a few leading steps while it searches down for its scale (not counted); a
#: quarter of the steps after that is far beyond the one skip per growth_interval it costs.
#: (A growth_interval short enough that 1 / (growth_interval + 1) exceeds it makes even one
#: skip after growing frequent.)
SKIP_RATE_THRESHOLD = 0.25
#: A loss scale below 1 shrinks the loss instead of protecting small gradients.
MIN_SCALE = 1.0
#: One overflow in a short run is what GradScaler is built for (a step at a scale it had not
#: tried to back off from yet, or one skip per growth_interval): it takes two to be frequent.
MIN_COUNTED_SKIPS = 2
#: log2(initial scale / the scale that worked) counts the halvings of a search; both are powers
#: of two, so it is an integer up to float rounding: this much above an integer still counts as
#: that integer.
SEARCH_HALVINGS_SLACK = 1e-9
#: scheduler-steps-on-skip: a scheduler that advances on skipped steps runs the schedule
#: 1 / (1 - r) times too fast at a steady skip rate r: at 4 % a 10,000-step cosine ends after
#: 9,600 real updates. GradScaler's own steady cost is one skip per growth_interval (1/2001 at
#: the default, 0.05 %), forty times below this; skips after the scale settled at more than this
#: rate (and at least MIN_COUNTED_SKIPS of them) are an error. The calibration skips before the
#: first real update are a constant shift of a few steps, judged by what they do to the learning
#: rate (the rung's rtol), not by this rate.
SCHEDULER_SKIP_RATE = 0.02

#: The clip-space rung forces max_grad_norm to this fraction of the true gradient norm so that
#: clipping really bites (how hard the pass clips, not a verdict).
FORCED_CLIP_FRACTION = 0.1

#: ddp-sync: a consumed gradient whose norm ratio to the global-batch reference is 1/world_size
#: to this relative precision (and points the same way, cosine above WORLD_SIZE_MIN_COSINE) is
#: the loss divided by the world size on top of DDP's own averaging; fp32 runs make a real
#: factor exact to rounding.
WORLD_SIZE_RATIO_RTOL = 1e-2
WORLD_SIZE_MIN_COSINE = 0.99
#: a DeepSpeed fp16 engine whose consumed gradient's norm ratio to the reference is its own loss
#: scale S (or 1/S) to this relative precision, pointing the same way (cosine above
#: SAME_DIRECTION_COSINE): the engine unscaled a loss it never scaled (or the reverse); fp16
#: rounding moves a ratio by far less, and S is a power of two far from every other factor.
ENGINE_SCALE_RTOL = 0.05
#: ddp-sync: ranks whose consumed gradients differ (relative to rank 0's) by more than the
#: ranks' own fp32 rtol consumed different gradients; this is the bound when a rank reported no
#: tolerance.
RANKS_APART_RTOL = 1e-4

# --- the static scan -------------------------------------------------------------------------

#: A number multiplied into the loss on its way to backward is a hand-written loss scale when it
#: is a power of two of at least 2**this (8): static scales are 128 to 2**16, while 2 and 4 are
#: ordinary factors of a loss.
MIN_LITERAL_SCALE_LOG2 = 3
#: A `*scale*` variable multiplied into the loss is a loss scale unless its known value is below
#: this (a scale of 1 is no scale).
MIN_NAMED_SCALE = 2
