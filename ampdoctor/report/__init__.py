"""Renderings of a run record: terminal (rich) and HTML. None of them imports torch."""
