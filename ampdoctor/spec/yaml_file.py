"""A spec file read as YAML: bounded (its size, the values its aliases expand to), a key given
twice refused, and the line of each key kept for messages. No torch, no pydantic here."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from ..core import limits
from ..core.errors import SpecError

#: A spec is a few hundred bytes; this bounds what a file can make ampdoctor read.
MAX_SPEC_BYTES = 1024 * 1024
#: Values (after YAML aliases are expanded) a spec may hold: an alias bomb stops here.
MAX_SPEC_VALUES = limits.MAX_VALUES


@functools.lru_cache(maxsize=8)
def top_level_lines(text: str) -> dict[str, int]:
    """Map each top-level key (and `key.sub`, `key.sub.name` for two levels of nesting:
    `hf_trainer.args.learning_rate`) to its 1-based line (cached: a spec's text is read for
    its lines several times; callers do not mutate it)."""
    lines: dict[str, int] = {}
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return lines
    if not isinstance(node, yaml.MappingNode):
        return lines
    for key_node, value_node in node.value:
        key = str(key_node.value)
        lines[key] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            for sub_key, sub_value in value_node.value:
                lines[f"{key}.{sub_key.value}"] = sub_key.start_mark.line + 1
                if isinstance(sub_value, yaml.MappingNode):
                    for name, _ in sub_value.value:
                        lines.setdefault(f"{key}.{sub_key.value}.{name.value}",
                                         name.start_mark.line + 1)
    return lines


class SpecLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice is an error (the last value would
    otherwise win in silence)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:   # an unhashable key: SafeLoader reports it itself
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line "
                    f"{first.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _bounded(data: Any, path: Path) -> None:
    if limits.exceeds(data, MAX_SPEC_VALUES):
        raise SpecError(f"{path}: the spec expands to more than {MAX_SPEC_VALUES:,} values "
                        "(YAML aliases nested in aliases?); a spec names code and a few "
                        "settings.")


def read_spec_yaml(path: Path) -> tuple[Any, str]:
    """The spec file's YAML data and its text; SpecError for a path that is not a readable
    file, a file over MAX_SPEC_BYTES, text that is not UTF-8 or not valid YAML, or YAML that
    expands to more than MAX_SPEC_VALUES values."""
    if not path.exists():
        raise SpecError(f"{path}: the spec file does not exist.")
    if path.is_dir():
        raise SpecError(f"{path}: is a folder; give the path of a YAML spec file.")
    if not path.is_file():
        raise SpecError(f"{path}: is not a regular file (a device or a pipe); give the path of "
                        "a YAML spec file.")
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: the spec is over {MAX_SPEC_BYTES // 1024} KiB; a spec "
                            "names code and a few settings.")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read the spec: {exc}", cause=exc) from exc
    try:
        data = yaml.load(text, Loader=SpecLoader)  # a SafeLoader subclass (safe)
        _bounded(data, path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{where}: the spec is not valid YAML: {problem}.", cause=exc) from exc
    return data, text
