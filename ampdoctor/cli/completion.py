"""Shell completion for what a person types most: the kinds `explain` takes and the rung ids
`--rungs` takes (each item of its comma-separated list). Read from the catalogue and the rung
list (no torch). `ampdoctor --install-completion` installs it in the shell."""

from __future__ import annotations


def complete_kind(incomplete: str) -> list[tuple[str, str]]:
    """The diagnosis kinds starting with what is typed, each with its title."""
    from ..kinds import CATALOGUE
    return [(name, entry.title) for name, entry in CATALOGUE.items()
            if name.startswith(incomplete)]


def complete_rungs(incomplete: str) -> list[str]:
    """`--rungs a,b,...`: the rung ids for the item being typed (after the last comma), each
    offered with the items before it; an id already listed is not offered again."""
    from ..core.findings import RUNG_IDS
    head, _, last = incomplete.rpartition(",")
    given = set(head.split(",")) if head else set()
    prefix = f"{head}," if head else ""
    return [f"{prefix}{rung}" for rung in RUNG_IDS
            if rung.startswith(last) and rung not in given]
