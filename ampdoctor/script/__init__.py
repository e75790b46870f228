"""Script mode: `ampdoctor diagnose train.py -- ARGS` on an unmodified training script.

The script runs as `__main__` (its argparse, its module-level code, its own data) in a child
process per run (`spawn` starts it, `child` runs it), under the probe, with what it does
switched from outside (`forcing`: every autocast it enters and every GradScaler it builds forced
to the rung's precision), stopped after N optimizer steps. What it did comes back and is
replayed as a Trace (`replay`). `session` holds the runs: the model, optimizers, scaler,
autocast dtype, K and micro-batches found in them, and the fp32 full-batch reference -- the same
script run with `--reference-args`, teacher-forced to the weights of the run under test at each
step, its data checked against the run's micro-batches row by row. The rungs (`rungs`) reuse
the judge and the rules; `diagnose` drives one diagnose and builds the record. Nothing here is
imported by `ampdoctor --help`.
"""
