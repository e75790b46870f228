"""ampdoctor: triage for gradient accumulation combined with mixed precision."""

__version__ = "0.1.0"
