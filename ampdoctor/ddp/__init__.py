"""The multi-process side of the `ddp-sync` rung: `launch` starts the ranks (spawned here, or
joining a torchrun launch), `rank` is what each of them runs and judges."""
