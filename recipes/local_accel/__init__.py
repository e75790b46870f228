"""A project-local, trimmed-down stand-in for Hugging Face accelerate (no dependency on it)."""
