"""Bounds on what a small hostile file can make ampdoctor do (a YAML alias bomb in a spec or in
a config under `scan`: a few hundred bytes that expand to billions of values)."""

from __future__ import annotations

from typing import Any

#: Values a loaded YAML/JSON document may hold once its aliases are expanded.
MAX_VALUES = 100_000


def exceeds(data: Any, limit: int = MAX_VALUES) -> bool:
    """Does `data` hold more than `limit` values, counting each alias where it is used? Stops
    counting at the limit, so a bomb costs at most `limit` steps."""
    count = 0
    stack = [data]
    while stack:
        item = stack.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
