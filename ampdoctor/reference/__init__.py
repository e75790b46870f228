"""What the loop meant, reproduced in fp32 (DESIGN §3a, "reference"): the gradients of the
micro-batches each step consumed (`gradients`) and the clipping the loop intended (`clips`)."""

from .clips import (
                    ClipCall,
                    ClippedReference,
                    attempt_events,
                    clip_calls,
                    clip_ops,
                    norm_of,
                    reference_norm,
)
from .gradients import (
    RANDOM_MODULE_TYPES,
    ReferenceBuilder,
    WindowReference,
    per_microbatch_full,
)

__all__ = ["ClipCall", "ClippedReference", "attempt_events", "clip_calls", "clip_ops",
           "norm_of", "reference_norm",
           "RANDOM_MODULE_TYPES", "ReferenceBuilder", "WindowReference", "per_microbatch_full"]
