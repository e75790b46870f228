"""The reference of a script whose K and micro-batch live in a config file it is handed
(`python train.py --config cfg.yaml`, the file holding `gradient_accumulation_steps: 4` and
`batch_size: 8`, at any depth): the same keys as an argparse option's names (`init.script`'s
K_FLAGS / BATCH_FLAGS), read from each YAML or JSON file among the script's arguments. The
reference gets a copy of that file with K = 1 and the micro-batch K x b, written to a folder of
ampdoctor's own (removed when the command ends), and its argument pointing at the copy: the
user's file is never changed. The copy keeps the file's name (a script may name its run after
it); its comments and key order are YAML's own dump's.

Not read: a config the script finds by itself (Hydra's `config_path`), one that includes
another by a relative path (the copy lives elsewhere), TOML.
"""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import processes

SUFFIXES = (".yaml", ".yml", ".json")
#: a section that is not the training's (its batch size is the evaluation's)
NOT_TRAINING = ("eval", "evaluation", "val", "valid", "validation", "test", "predict",
                "inference", "generation")


@dataclass(frozen=True)
class ConfigSetting:
    """A key of a config file among the script's arguments."""

    index: int           # of the argument that names the file
    text: str            # the file as written in that argument
    path: Path
    keys: tuple[str, ...]
    value: int

    @property
    def shown(self) -> str:
        return ".".join(self.keys)


@dataclass
class ConfigFile:
    index: int
    text: str
    path: Path
    data: Any


def config_files(args: list[str], cwd: str) -> list[ConfigFile]:
    """The YAML/JSON files among `args` (`cfg.yaml`, `--config cfg.yaml`, `--config=cfg.yaml`)
    that load as a mapping."""
    found = []
    for index, arg in enumerate(args):
        text = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        path = Path(cwd, text)
        if path.suffix.lower() not in SUFFIXES or not path.is_file():
            continue
        try:
            raw = path.read_text(encoding="utf-8")
            if path.suffix.lower() == ".json":
                data = json.loads(raw)
            else:
                import yaml
                data = yaml.safe_load(raw)
        except Exception:  # noqa: BLE001 - unreadable, not JSON/YAML (yaml's own errors too)
            continue
        if isinstance(data, dict):
            found.append(ConfigFile(index, text, path, data))
    return found


def _paths(data: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out: list[tuple[tuple[str, ...], Any]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(key, str):
                out += _paths(value, (*prefix, key))
    elif prefix:
        out.append((prefix, data))
    return out


def _normal(key: str) -> str:
    return key.replace("-", "_").lower()


def find(files: list[ConfigFile], names: tuple[str, ...],
         near: ConfigSetting | None = None) -> ConfigSetting | list[str] | None:
    """The setting of the first of `names` (in their order) found in `files`: one whose value is
    a whole number, outside an evaluation section; beside `near` (the same section) when
    several are; the candidates' names when still several; None when none."""
    for name in names:
        found = [(f, keys, value) for f in files for keys, value in _paths(f.data)
                 if _normal(keys[-1]) == name and isinstance(value, int)
                 and not isinstance(value, bool)]
        if not found:
            continue
        training = [c for c in found
                    if not any(_normal(k) in NOT_TRAINING for k in c[1][:-1])] or found
        if len(training) > 1 and near is not None:
            training = [c for c in training if c[0].path == near.path
                        and c[1][:-1] == near.keys[:-1]] or training
        if len(training) > 1:
            return [f"{c[0].text}: {'.'.join(c[1])}" for c in training]
        f, keys, value = training[0]
        return ConfigSetting(f.index, f.text, f.path, keys, value)
    return None


def _set(data: Any, keys: tuple[str, ...], value: int) -> None:
    for key in keys[:-1]:
        data = data[key]
    data[keys[-1]] = value


#: the folders of the copies this process made (`remove_copies`)
_FOLDERS: list[str] = []


def remove_copies() -> None:
    """Remove the copies made so far (the diagnose that reads them has ended)."""
    while _FOLDERS:
        shutil.rmtree(_FOLDERS.pop(), ignore_errors=True)


def reference_copy(args: list[str], files: list[ConfigFile], changes: list[tuple[ConfigSetting,
                   int]]) -> list[str]:
    """`args` with each changed file's argument pointing at a copy of it that holds the new
    values (`changes`: (setting, value)); the copies in a folder removed when the command
    ends."""
    out = list(args)
    folder = tempfile.mkdtemp(prefix=processes.REFERENCE_COPY_PREFIX, dir=processes.temp_root())
    if not _FOLDERS:
        atexit.register(remove_copies)     # (the CLI removes them when its diagnose ends)
    _FOLDERS.append(folder)
    for f in files:
        mine = [(s, v) for s, v in changes if s.index == f.index]
        if not mine:
            continue
        data = copy.deepcopy(f.data)
        for setting, value in mine:
            _set(data, setting.keys, value)
        target = Path(folder, str(f.index), f.path.name)
        target.parent.mkdir()
        if f.path.suffix.lower() == ".json":
            text = json.dumps(data, indent=2) + "\n"
        else:
            import yaml
            text = yaml.safe_dump(data, sort_keys=False)
        target.write_text(text, encoding="utf-8")
        arg = out[f.index]
        out[f.index] = (arg.split("=", 1)[0] + "=" + str(target)
                        if arg.startswith("-") and "=" in arg else str(target))
    return out
