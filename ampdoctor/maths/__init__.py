"""Tensor maths without a run: the comparison of a consumed gradient with its reference
(compare), tensors held shard-wise (shards), seeding (rng). The package imports nothing
itself, so `import ampdoctor.maths.x` costs only x."""
